"""The checks that refuse a recording, and what their messages advise.

After classification (`tf_pxg.interface.classify.Classifier`), the engine
(`tf_pxg.per_example.backward`) refuses a recording whose data path mixes
examples (`check_examples_independent`), whose ops write state from the
examples' values (`check_no_data_writes`), or during which Python read a
value computed from the examples (`check_no_host_reads`). Each error names
the op and its scope, says why, and says what to do instead (`_hint`).
"""

from __future__ import annotations

from typing import Sequence

from tf_pxg import _compat
from tf_pxg.interface import batch_axis
from tf_pxg.interface.classify import Classifier
from tf_pxg.tape import library_constants
from tf_pxg.tape import recording
from tf_pxg.tape import side_effects
from tf_pxg.tape.recording import Entry, Recorder, tensor_id

_BATCH_NORMS = ("FusedBatchNorm", "FusedBatchNormV2", "FusedBatchNormV3")


def _mixing(entry: Entry, classifier: Classifier):
  if entry.op_type in _BATCH_NORMS:
    try:
      training = recording.get_attr(entry, "is_training")
    except (ValueError, KeyError):
      training = True
    if training:
      return batch_axis.Mixing(
          batch_axis.MIXES, "normalises with statistics of the whole batch")
  return classifier.mixing.get(id(entry))


def _hint(entry: Entry, mixing) -> str:
  why = mixing.why
  if entry.op_type.startswith("TensorList"):
    return (" A tf.TensorArray in a tf.function (a TensorList) must hold "
            "the whole batch in each element: write one [B, ...] step per "
            "index, and unstack or scatter time-major [T, B, ...] tensors, "
            "not batch-major ones.")
  if "shape" in why and "values" in why:
    return (" A shape, size or count of elements selected by value "
            "(tf.where(cond) with one argument, tf.boolean_mask, tf.unique, "
            "tf.dynamic_partition, ragged filters) counts over the whole "
            "batch. Keep shapes static and per example instead: mask "
            "elementwise with tf.where(cond, x, 0) (three arguments), count "
            "per example with tf.reduce_sum(tf.cast(cond, x.dtype), axis=-1), "
            "or pad to a fixed size. Shapes "
            "that depend only on the batch size (tf.shape(x)[0], "
            "tf.reshape(x, [-1, d])) are fine.")
  if "takes its argument" in why:
    return (" Whatever the data touches is data, at every input of every op. "
            "Give the argument a value that does not depend on the examples: "
            "a constant (the vocabulary size as one_hot's depth, a fixed "
            "sequence length to slice or pad to, a seed from the layer's "
            "keras.random.SeedGenerator), or a shape that depends only on "
            "the batch size (tf.shape(x)[0]). Per-example choices belong in "
            "the rows: mask with tf.where(cond, x, y) where cond has one row "
            "per example.")
  if "row partition" in why:
    return (" Split strings with tf.strings.split on a [B] batch, or pad each "
            "example to a fixed length instead of packing sequences.")
  if "statistics" in why:
    return (" BatchNormalization in training does this; use "
            "keras.layers.GroupNormalization or "
            "keras.layers.LayerNormalization instead (or freeze the layer "
            "and call it with training=False); standardise each example "
            "with its own statistics, or with constants computed beforehand.")
  if "allowlist" in why:
    return (" If this op acts on each example's rows alone, add it with "
            f"tf_pxg.register_row_wise('{entry.op_type}') (a rule says how "
            "it moves the batch axis; see tf_pxg.interface.batch_axis).")
  if "gathers along the batch axis" in why or "rows" in why:
    return (" Augmentations that combine examples (keras.layers.MixUp, "
            "keras.layers.CutMix) and ops that permute, sort, roll, reverse "
            "or select examples make an example's loss depend on others; "
            "use per-example augmentations (RandomFlip, RandomCrop, "
            "RandomRotation, ...) and per-example computations.")
  if "pairs" in why or "contracts" in why:
    return (" A loss that compares an example with the other examples of "
            "its batch (in-batch negatives, logits z_a @ z_b^T, contrastive "
            "losses) is not a per-example loss; use fixed or per-example "
            "negatives.")
  return (" Check which axis holds the examples: tf_pxg follows the batch "
          "axis through transposes, reshapes and contractions, and an op "
          "may reduce or contract any other axis.")


def check_examples_independent(entries: Sequence[Entry],
                               classifier: Classifier,
                               vector_target: bool) -> None:
  """Raises at the first of `entries` that mixes examples.

  `entries` should be `data_path(...)`: the allowlist contract of
  `tf_pxg.interface.batch_axis` is checked on every op from the inputs to the target.
  A reduction over the batch axis is allowed only for a scalar target
  (which is a sum over examples); everything else that mixes, or may (an
  op off the allowlist), raises whatever the target.

  Raises:
    ValueError: naming the op, its name scope (the Keras layer), why it
      mixes examples and what to do instead.
  """
  for entry in entries:
    mixing = _mixing(entry, classifier)
    if mixing is None or (mixing.kind == batch_axis.REDUCES and
                          not vector_target):
      continue
    raise ValueError(
        f"{entry.describe()} mixes examples: it {mixing.why}, so an "
        "example's loss and gradient would depend on the other examples of "
        "the batch and clipping its gradient would not bound its influence "
        f"(no per-example gradient, no DP guarantee).{_hint(entry, mixing)}"
        f"{library_constants.missing_literals_hint()}")


def check_no_data_writes(recorder: Recorder, classifier: Classifier) -> None:
  """Raises if the recording changes state from the data: an op without
  outputs (a variable assignment, a table insert, a summary or print), an
  op that may change a resource it takes (`side_effects.is_resource_writer`),
  or a `tf.cond`/`tf.while_loop`/function call whose body does
  (`side_effects.body_writes`), with an input that holds values of examples.

  Such state is read back later in the step or in later steps, saved with
  the model or printed: an exit of the data besides the clipped, noised sum
  (invariant 4 of docs/design.md's guarantee). The Keras step checks the
  same with its declared data (`tf_pxg.keras._validation`); this check
  serves the tape used directly.

  Raises:
    ValueError: naming the op, its scope and what to do instead.
  """
  values = set()
  for e in list(recorder.entries) + list(recorder.writes):
    values.update(tid for tid, t in zip(e.input_ids, e.inputs)
                  if classifier.carries_values(tid, t))
  writes = side_effects.data_dependent_writes(
      recorder.writes, values, recorder.entries, _compat.function_body)
  if writes:
    raise ValueError(
        f"{writes[0].describe()} changes state (a variable, a lookup table, "
        "a TensorArray, a summary or print, or a write inside a tf.cond, "
        "tf.while_loop or function body) from values computed from the "
        "examples. State read back later in the step or in later steps, "
        "saved with the model, or printed carries the data out other than "
        "through the clipped, noised gradient sum (no DP guarantee). "
        "Compute such state outside the DP step from public data, or make "
        "it depend only on the weights and constants.")


def check_no_host_reads(recorder: Recorder, classifier: Classifier) -> None:
  """Raises if Python read, while an eager tape recorded, the value of a
  tensor computed from the examples (`Recorder.host_reads`): an `if` on a
  tensor, an eager `tf.cond` or `tf.while_loop` predicate, `.numpy()`,
  `int()`. The value leaves the recorded computation, and what Python does
  with it (which branch runs, how many iterations, a size) steers every
  example's computation unseen: with a predicate `tf.reduce_max(x) > 10`,
  one outlier flips every other example's branch. Inside `tf.function`
  such reads are trace-time errors or recorded ops (`tf.cond` builds an
  `If`), and `fit` always traces the DP step.

  Raises:
    ValueError: naming the op that computed the value and what to do.
  """
  for t in recorder.host_reads:
    tid = tensor_id(t)
    if not classifier.carries_values(tid, t):
      continue
    producer = recorder.producer.get(tid)
    what = producer.describe() if producer is not None else "an input"
    raise ValueError(
        f"Python read the value of a tensor computed from the examples "
        f"({what} made it) while the tape recorded eagerly: an if on a "
        "tensor, an eager tf.cond or tf.while_loop predicate, .numpy() or "
        "int(). That value steers the computation outside the recording, "
        "so one example could change how every other example is computed "
        "(no per-example gradient, no DP guarantee). Run the forward pass "
        "in tf.function (tf.cond and tf.while_loop become recorded ops), "
        "select per example with tf.where(cond, x, y), or decide the branch "
        "from constants.")
