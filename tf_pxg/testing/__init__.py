"""Reference checks for per-example gradients (for rule and layer authors).

`reference_per_example_gradients` is the ground truth: a plain
`tf.GradientTape` loop that runs the model on one example at a time (a batch
of one, sliced out of axis 0) and stacks the gradients. It knows nothing of
tf_pxg, so it is slow but obviously right.

`check_per_example_gradients` runs tf_pxg's three per-example questions
(`per_example_gradient`, `per_example_norms`, `clipped_gradient_sum`) on the
whole batch, eagerly, in a `tf.function` or under XLA, and compares them with
the quantities derived from the reference:

* norms: `n_b = sqrt(sum over variables of ||g_b||^2)` (flat, global L2);
* clipped sum: `sum_b min(1, C / n_b) g_b` per variable.

`check_gradient_invariants` needs no reference loop: with a clip so large
that nothing is clipped, `clipped_gradient_sum` must equal the plain
`tf.GradientTape` gradient of the summed loss for every source, the
per-example gradients must sum to it, and a source whose plain gradient is
non-zero must never get a `None` or all-zero per-example gradient.

`expected_dp_sgd_weights` turns reference gradients into the weights one
noiseless DP-SGD step must give (`w - lr * mean_b min(1, C / n_b) g_b`), and
`assert_dp_step_matches_reference` checks a real step against them to `rtol`
of each variable's update size.

`check_example_independence` needs neither tf_pxg's engine nor a reference:
it changes one example of a batch and checks, with a plain
`tf.GradientTape`, that no other example's loss or gradient moves (the
random layers re-seeded identically in both runs). It catches layers that
mix examples (MixUp, BatchNormalization in training, batch statistics,
in-batch negatives...), as far as the chosen change exercises them.

`adversary` is the generated adversary of issue 49: seeded compositions of
small models from an op vocabulary whose every input position (values,
sizes, depths, seeds, conditions, slice bounds, indices, partitions, table
keys) is fed from a constant, a per-example value or a batch statistic, and
`adversary.check_models`, which requires each to be refused by name or to be
exact against the single-example loop with a replace-one influence of at
most 2C, eagerly, in `tf.function` and under XLA (docs/testing.md).

`trace_rules` records which rule, and which form of it, tf_pxg ran at each
interface op (e.g. the ghost or the materialised squared norm, or the
vectorized fallback), so a test can tell a rule from the fallback.

Tolerances follow the gradients' scale: an array passes when
`|actual - expected| <= atol + rtol * max|expected| + floor`, where the
noise floor `64 * eps(dtype) * S` is relative to the largest per-example
gradient entry S over all the variables checked together. A gradient that is
zero in exact arithmetic (e.g. an attention key bias, softmax being
shift-invariant) is float noise at the scale of the gradients it was summed
from, and two such noises are never compared under a relative tolerance.

Use it to test a rule you registered with `tf_pxg.register` or a layer of
your own:

    err = tf_pxg.testing.check_per_example_gradients(
        keras.losses.SparseCategoricalCrossentropy(reduction="none"),
        model, model.trainable_variables, x, labels=y, mode="jit")

Warning:
  The contract is that of DP-SGD: the batch is axis 0 of every input and
  label, the loss is a `[B]` vector of per-example losses, and example b's
  loss depends on example b alone (no batch normalisation in training, no
  dropout or other randomness, which would also break the comparison with
  the reference loop; `check_gradient_invariants` allows randomness).

References:
  Opacus, `opacus.utils.tensor_utils` / `check_per_sample_gradients_are_correct`
  (the batch-of-one loop as a reference).
"""

from tf_pxg.testing import adversary
from tf_pxg.testing.checks import check_gradient_invariants
from tf_pxg.testing.checks import check_per_example_gradients
from tf_pxg.testing.dp_step import assert_dp_step_matches_reference
from tf_pxg.testing.dp_step import expected_dp_sgd_weights
from tf_pxg.testing.dp_step import per_example_global_norms
from tf_pxg.testing.independence import CHANGES
from tf_pxg.testing.independence import ExampleIndependenceResult
from tf_pxg.testing.independence import ExampleMixingError
from tf_pxg.testing.independence import check_example_independence
from tf_pxg.testing.reference import reference_per_example_gradients
from tf_pxg.testing.tolerances import MODES
from tf_pxg.testing.tracing import trace_rules

__all__ = ["CHANGES", "ExampleIndependenceResult", "ExampleMixingError",
           "MODES", "adversary", "assert_dp_step_matches_reference",
           "check_example_independence", "check_gradient_invariants",
           "check_per_example_gradients", "expected_dp_sgd_weights",
           "per_example_global_norms", "reference_per_example_gradients",
           "trace_rules"]
