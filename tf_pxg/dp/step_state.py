"""`StepState`: what a DP step keeps between physical batches, in one object.

A DP train step keeps, from one physical batch to the next, state that is
not model state and is never saved: the logical step's running sums
(`tf_pxg.dp.accumulation.LogicalStepAccumulator`s: the gradients' with the
side releases', and those a noise mechanism keeps, e.g. DP-AdaFEST's
selection counts) and, in an audit only, the hook that adds gradient
canaries to the clipped sum. They live in one typed object held by the
`tf_pxg.keras.DPOptimizer` (as `step_state`, untracked: a checkpoint must
not carry a half-accumulated logical step, and a resumed run starts a
fresh one), not in attributes set on the Keras model by the parts that
need them.

The saved DP state (the adaptive clip, noise buffers, side releases'
state, the privacy ledger) is `tf_pxg.keras._dp_state.DPState`, tracked
and checkpointed; this is its unsaved counterpart.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import tensorflow as tf

__all__ = ["StepState"]


class StepState:
  """The unsaved per-step state of a DP run (module docstring).

  Attributes:
    clipped_sum_hook: None, or `hook(model, sums, variables, info, clip,
      clipping) -> sums` that the clip stage calls right after the clipped
      sum (`tf_pxg.audit.gradient_canaries.attach` sets it; read when the
      step is traced).
    audit: what the attached audit keeps (its gradient canaries), or None.
  """

  def __init__(self):
    self._made: Dict[str, Tuple[Hashable, Any]] = {}
    self.clipped_sum_hook: Optional[Callable] = None
    self.audit: Any = None

  def get(self, name: str, key: Hashable, make: Callable[[], Any]) -> Any:
    """The object stored under `name` if it was made for `key`, else
    `make()` (called in an init scope, so that variables it creates are
    lifted out of a traced step into the strategy scope), stored.

    Args:
      name: what it is ("gradient" for the gradient sums' accumulator, a
        mechanism's own name for its).
      key: what it was made for (e.g. the variables' ids and the number of
        side releases); another key makes a new one.
      make: builds it.
    """
    made = self._made.get(name)
    if made is None or made[0] != key:
      with tf.init_scope():
        made = (key, make())
      self._made[name] = made
    return made[1]

  def accumulator(self, name: str, variables, num_scalars: int = 0):
    """The `LogicalStepAccumulator` `name` for `variables` (or
    `tf.TensorSpec`s) and `num_scalars` extra scalar sums, made if needed.
    Variables are matched by identity, specs by shape and dtype."""
    from tf_pxg.dp import accumulation  # noqa: PLC0415
    key = (tuple(v if isinstance(v, tf.TensorSpec) else id(v)
                 for v in variables), int(num_scalars))
    return self.get(name, key, lambda: accumulation.LogicalStepAccumulator(
        variables, num_scalars))
