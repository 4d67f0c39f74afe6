"""How `check_example_independence` runs the model: the same randomness
every time (the model's non-trainable state restored, the seeds set), and
either a full pass (every example's own gradient) or the search's cheap
screen (a random combination of the other examples' gradients)."""

from __future__ import annotations

from typing import Any, Callable, List, NamedTuple, Optional

import numpy as np
import tensorflow as tf

from tf_pxg import _compat
from tf_pxg.testing.checks import _run_in_mode
from tf_pxg.testing.dilated_conv import _dilation_free_conv_gradients
from tf_pxg.testing.reference import _dense, _per_example_loss
from tf_pxg.testing.tolerances import _numpy, _variable_dtype


def _keras_seed_states(model) -> set:
  """ids of the state variables of the Keras `SeedGenerator`s in `model`."""
  ids = set()
  for layer in _compat.flatten_layers(model, include_self=True):
    for generator in _compat.seed_generators(layer):
      state = getattr(generator, "state", None)
      if state is not None:
        ids.add(id(state))
  return ids


def _model_state(model) -> List[Any]:
  """The model's non-trainable state: Keras' `non_trainable_variables`
  (moving statistics, SeedGenerator states, power-iteration vectors...)."""
  variables = getattr(model, "non_trainable_variables", None)
  if variables is None:
    return []
  return [v for v in variables if hasattr(v, "assign")]


def _reseed(seed: int) -> None:
  """`keras.utils.set_random_seed(seed)` and a fresh global Keras
  SeedGenerator made eagerly (so unseeded `keras.random` calls draw the same
  values in every run, eagerly and in a `tf.function`)."""
  try:
    import keras  # pylint: disable=g-import-not-at-top
  except ImportError:  # pragma: no cover - tf_pxg's tests always have Keras
    tf.random.set_seed(seed)
    return
  keras.utils.set_random_seed(seed)
  try:
    _compat.reset_global_seed_generator()
  except (ImportError, AttributeError):  # pragma: no cover - other Keras
    pass


class Setup(NamedTuple):
  """What every stage of the check reads (fixed before the first run)."""
  model: Any
  loss_fn: Callable
  variables: List[Any]
  x: Any
  y: Any
  training: Optional[bool]
  mode: str
  gradients: bool
  b_total: int
  rtol: Optional[float]
  atol: float
  names: List[str]


class Pass(NamedTuple):
  """One run's results: the per-example losses `[B]`, and either the
  per-example gradients `[B, *v.shape]` per variable (a full pass) or the
  screen's `[Σ_b w_b g_b per variable] + [g_index per variable]`."""
  loss_dtype: Any
  losses: np.ndarray
  grads: List[np.ndarray]


def full_pass(setup: Setup, inputs, labels) -> Pass:
  """Per-example losses `[B]` and (if `gradients`) per-example gradients
  `[B, *v.shape]` per variable: the gradient of `loss[b]` with the whole
  batch in the forward pass, from a plain persistent `tf.GradientTape`."""
  variables = setup.variables

  def compute(inputs, labels):
    with tf.GradientTape(persistent=True) as tape:
      losses = _per_example_loss(setup.loss_fn, setup.model, inputs, labels,
                                 setup.training)
      # Sliced on the tape, so that each row is differentiable.
      rows = tf.unstack(losses) if setup.gradients else []
    if not setup.gradients:
      return losses, []
    per_b = []
    for row in rows:
      grads = tape.gradient(row, variables)
      per_b.append([tf.cast(_dense(g, v), _variable_dtype(v))
                    for g, v in zip(grads, variables)])
    del tape
    return losses, [tf.stack([gs[i] for gs in per_b])
                    for i in range(len(variables))]

  with _dilation_free_conv_gradients():
    losses, grads = _run_in_mode(compute, inputs, labels, setup.mode)
  return Pass(losses.dtype, _numpy(losses), [_numpy(g) for g in grads])


def screen_pass(setup: Setup, inputs, labels, index: int,
                 weights: np.ndarray) -> Pass:
  """The search's cheap run: the losses, the gradient of
  `Σ_b weights[b] loss[b]` (`weights[index]` = 0: the OTHER examples'
  gradients, each with a random weight, so that any of them moving moves
  it) and example `index`'s own gradient; two backward passes, not B."""
  variables = setup.variables

  def compute(inputs, labels):
    with tf.GradientTape(persistent=True) as tape:
      losses = _per_example_loss(setup.loss_fn, setup.model, inputs, labels,
                                 setup.training)
      others = tf.reduce_sum(losses * tf.constant(weights, losses.dtype))
      own = losses[index]
    if not setup.gradients:
      return losses, []
    grads = (tape.gradient(others, variables) +
             tape.gradient(own, variables))
    del tape
    return losses, [tf.cast(_dense(g, v), _variable_dtype(v))
                    for g, v in zip(grads, variables + variables)]

  with _dilation_free_conv_gradients():
    losses, grads = _run_in_mode(compute, inputs, labels, setup.mode)
  return Pass(losses.dtype, _numpy(losses), [_numpy(g) for g in grads])


class Runner:
  """Runs the model on a batch with the same randomness every time: the
  model's non-trainable state restored and the seeds set before each run."""

  def __init__(self, setup: Setup, seed: Optional[int]):
    self.setup, self.seed = setup, seed
    self.state = _model_state(setup.model)
    self.saved = [tf.identity(v) for v in self.state]
    self.seed_ids = _keras_seed_states(setup.model)

  def restore(self, include_seed_states: bool) -> None:
    for v, value in zip(self.state, self.saved):
      if include_seed_states or id(v) not in self.seed_ids:
        v.assign(value)

  def _prepare_run(self) -> None:
    self.restore(include_seed_states=self.seed is not None)
    if self.seed is not None:
      _reseed(self.seed)

  def full(self, inputs, labels) -> Pass:
    self._prepare_run()
    return full_pass(self.setup, inputs, labels)

  def screen(self, inputs, labels, index: int, weights) -> Pass:
    self._prepare_run()
    return screen_pass(self.setup, inputs, labels, index, weights)
