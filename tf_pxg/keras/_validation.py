"""Checks of DP models, with errors that say what to do (the DP settings
themselves are validated in one place, `tf_pxg.dp.plan.DPPlan.validated`)."""

from __future__ import annotations

import keras
import numpy as np
import tensorflow as tf

from tf_pxg import _compat


def _mixing_augmentations() -> tuple:
  """Keras' augmentation layers that combine examples of a batch."""
  return tuple(getattr(keras.layers, name) for name in ("MixUp", "CutMix")
               if hasattr(keras.layers, name))


def check_no_batch_mixing_layers(model: keras.Model) -> None:
  """Raises for layers known to mix examples, naming the layer.

  Trainable BatchNormalization layers (batch statistics in training), and
  MixUp / CutMix (each example is blended with another of the batch). A
  BatchNormalization layer with `trainable=False` runs in inference mode
  (moving statistics), so each example's output depends on that example
  only; it is allowed. Other mixing ops are refused by the engine's
  allowlist (`tf_pxg.interface.batch_axis`) at the first training step, before any
  update.
  """
  mixers = _mixing_augmentations()
  for layer in _compat.flatten_layers(model, include_self=False):
    if isinstance(layer, keras.layers.BatchNormalization) and layer.trainable:
      raise ValueError(
          f"Layer {layer.name!r} of model {model.name!r} is a "
          "BatchNormalization layer: in training it normalises with "
          "statistics of the whole batch, so an example's gradient depends on "
          "the other examples and per-example clipping cannot bound its "
          "influence (no DP guarantee). Replace it with "
          "keras.layers.GroupNormalization or keras.layers.LayerNormalization "
          "(or freeze it with `layer.trainable = False`).")
    if getattr(layer, "stateful", False) is True:
      raise ValueError(
          f"Layer {layer.name!r} of model {model.name!r} has stateful=True: "
          "it carries each row's final state into the next batch's initial "
          "state (a variable written from the data in the forward pass), so "
          "one batch's examples influence the next batch's losses and the "
          "saved model holds un-noised states computed from the data (no DP "
          "guarantee). Create the layer with stateful=False (the default); "
          "to keep context across chunks of a sequence, make the chunks one "
          "longer example.")
    if mixers and isinstance(layer, mixers):
      raise ValueError(
          f"Layer {layer.name!r} of model {model.name!r} is a "
          f"{type(layer).__name__} layer: in training it blends each example "
          "with another example of the batch, so an example's loss depends "
          "on other examples and per-example clipping cannot bound its "
          "influence (no DP guarantee). Remove it, and augment each example "
          "on its own (RandomFlip, RandomCrop, RandomTranslation, "
          "RandomRotation, ...).")


def check_forward_side_effects(model: keras.Model, tape, data) -> None:
  """Raises, before any update, if the recorded forward pass carries the data
  out other than through the loss.

  * A state write whose value depends on `data` (`tape.data_dependent_writes`;
    the argument is in `tf_pxg.tape.side_effects`): a running statistic
    assigned in `call`, a scatter update, a summary write. Writes of
    data-independent values (a step counter, a seed generator's state) are
    allowed.
  * A term added with `layer.add_loss(...)` during the call: Keras adds it to
    the batch loss, but DP-SGD differentiates each example's loss alone, so
    the term would be silently dropped (a batch-level term has no
    per-example split that the clip could bound).

  Args:
    model: the model whose forward pass `tape` recorded.
    tape: the `tf_pxg.GradientTape`, before its gradient is taken.
    data: a nest of the step's data tensors (inputs, labels, weights).

  Raises:
    ValueError: naming the layer, the variable or term, and what to do.
  """
  writes = tape.data_dependent_writes(data, model.variables)
  if writes:
    entry, variable = writes[0]
    what = (f"variable {getattr(variable, 'path', variable.name)!r}"
            if variable is not None else "a variable")
    raise ValueError(
        f"Model {model.name!r}: {entry.describe()} writes {what} from the "
        "training data in the forward pass (e.g. a running statistic "
        "assigned in a layer's call, like BatchNormalization's moving mean). "
        "DP training releases the data only through the clipped, noised "
        "gradient sum; this variable would be saved with the model holding "
        "an un-noised function of each batch. Compute such statistics "
        "outside the DP step (from public data, or under the layer's "
        "training=False branch), or make the variable depend only on the "
        "weights. Writes of data-independent values (counters, seed "
        "generators) are allowed.")
  for layer in _compat.flatten_layers(model, include_self=True):
    if not all(_identically_zero(t) for t in _compat.added_losses(layer)):
      raise ValueError(
          f"Layer {layer.name!r} of model {model.name!r} adds a loss term "
          "with add_loss() in its call. DP training clips each example's "
          "gradient of its own loss, and a batch-level term has no "
          "per-example split, so it cannot be included (and would otherwise "
          "be silently dropped). Return the term per example as a model "
          "output and give that output its own compiled loss, or, if it "
          "depends only on the weights, use a kernel_regularizer (added "
          "unclipped, like every weight regularizer). A term scaled by a "
          "constant 0 is accepted (e.g. KerasHub's mixture-of-experts "
          "router loss with router_aux_loss_coefficient=0).")


# Ops through which a zero factor stays zero.
_PASS_THROUGH = ("Identity", "Cast")
_PRODUCTS = ("Mul", "MulNoNan")


def _identically_zero(term) -> bool:
  """Whether an `add_loss` term is a product with a constant zero factor.

  Such a term (KerasHub's MoE router loss built as
  `router_aux_loss_coefficient * aux_loss` with the coefficient 0) adds
  nothing to plain Keras' loss (a non-finite `aux_loss` aside, which would
  make that loss NaN), so dropping it changes no gradient and releases
  nothing: the step's output still depends on the data only through the
  clipped, noised sum. Read from the graph (`fit`'s traced step, XLA
  included); an eager tensor has no op to read, so under
  `run_eagerly=True` every term counts as non-zero and is refused.
  """
  op = getattr(term, "op", None)  # EagerTensor.op raises AttributeError.
  while op is not None and op.type in _PASS_THROUGH:
    op = op.inputs[0].op
  if op is None or op.type not in _PRODUCTS:
    return False
  for factor in op.inputs:
    value = tf.get_static_value(factor)
    if value is not None and not np.any(value):
      return True
  return False


def check_no_data_dependent_losses(model: keras.Model) -> None:
  """Raises for activity regularizers (batch-level, data-dependent losses)."""
  for layer in _compat.flatten_layers(model, include_self=True):
    if getattr(layer, "activity_regularizer", None) is not None:
      raise ValueError(
          f"Layer {layer.name!r} has an activity_regularizer: it adds a "
          "batch-level loss that depends on the data, which DP training "
          "cannot clip per example. Remove it, or express it as part of a "
          "per-example loss.")


def check_no_validation_split(model: keras.Model, validation_split) -> None:
  """Refuses `fit(validation_split=...)` on a DP model.

  Keras' `validation_split` takes the validation rows from the arrays
  passed as `x` and `y`, the private training data, and logs `val_*` values
  computed on them, un-noised: ε does not cover them (those rows are not
  trained on), and one held-out row moves `val_loss` without bound, into
  the logs and into any callback that monitors it. It also leaves fewer
  training rows than `len(x)`, so a `PrivacyCallback(num_examples=len(x))`
  would account for another sampling rate. `fit` calls this first, before
  any data handling or callback.

  Raises:
    ValueError: `validation_split` is set (neither 0 nor None), naming it
      and what to pass instead.
  """
  if not validation_split:
    return
  raise ValueError(
      f"Model {model.name!r}.fit got validation_split={validation_split!r}. "
      "Under DP it is refused: Keras would take the validation rows from "
      "the private arrays passed as x and y and log un-noised val_* values "
      "computed on them (not covered by ε: one held-out row moves val_loss "
      "without bound), and train on fewer rows than len(x), so "
      "PrivacyCallback(num_examples=len(x)) would account for the wrong "
      "sampling rate. Split off a held-out validation set yourself and pass "
      "validation_data=(x_val, y_val), with x and y the training rows only "
      "(and PrivacyCallback(num_examples=len(x_train))). Validation values "
      "are then computed on data you treat as public (docs/threat_model.md, "
      "\"validation_split\").")
