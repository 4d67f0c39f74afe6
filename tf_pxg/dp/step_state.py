"""`StepState`: what a DP run keeps between steps and never saves.

A DP run keeps, from one physical batch to the next, state that is not
model state and is never saved:

- the noise generator (`tf_pxg.dp.noise.make_generator`): its state
  advances every step; saving it would let a resumed run replay the same
  noise on other data and anyone holding the checkpoint predict the noise
  (docs/threat_model.md, "Checkpoints");
- the step limit (an int64 variable, `NO_STEP_LIMIT` for none): the
  budget of one `fit`, which `tf_pxg.keras.PrivacyCallback` sets and the
  compiled step reads;
- the sampler the last `fit` built (`tf_pxg.data.samplers.Sampler`), whose
  event the callback composes;
- the logical step's running sums
  (`tf_pxg.dp.accumulation.LogicalStepAccumulator`s: the gradients' with
  the side releases', and those a noise mechanism keeps, e.g.
  DP-AdaFEST's selection counts);
- in an audit only, the hook that adds gradient canaries to the clipped
  sum.

They live in one typed object held by the `tf_pxg.keras.DPOptimizer` (as
`step_state`, untracked: a checkpoint must not carry a half-accumulated
logical step or the generator's state, and a resumed run starts fresh),
not in attributes set on the Keras model by the parts that need them. A
recompile with another optimizer hands the run over (`take_over`).

The saved DP state (the adaptive clip, noise buffers, side releases'
state, the privacy ledger) is `tf_pxg.keras._dp_state.DPState`, tracked
and checkpointed; this is its unsaved counterpart.
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Hashable, Optional, Tuple

import tensorflow as tf

from tf_pxg.dp import noise as dp_noise

__all__ = ["NO_STEP_LIMIT", "StepState"]

#: The step limit's "no limit".
NO_STEP_LIMIT = tf.int64.max


class StepState:
  """The unsaved per-step state of a DP run (module docstring).

  Attributes:
    generator: the run's noise `tf.random.Generator` (made by `start`), or
      None before; the noise mechanism picks the source it draws from
      (`NoiseMechanism.noise_source`: OS keys in secure mode).
    step_limit: int64 variable (made by `start`): the step applies an
      update only while the step count is below it (`NO_STEP_LIMIT`: no
      limit); None before.
    sampler: the `tf_pxg.data.samplers.Sampler` the last `fit` built, or
      None (no `fit` yet, a custom loop).
    clipped_sum_hook: None, or `hook(model, sums, variables, info, clip,
      clipping) -> sums` that the clip stage calls right after the clipped
      sum (`tf_pxg.audit.gradient_canaries.attach` sets it; read when the
      step is traced).
    audit: what the attached audit keeps (its gradient canaries), or None.
  """

  def __init__(self):
    self._made: Dict[str, Tuple[Hashable, Any]] = {}
    self.generator: Optional[tf.random.Generator] = None
    self.step_limit: Optional[tf.Variable] = None
    self.sampler: Any = None
    self.clipped_sum_hook: Optional[Callable] = None
    self.audit: Any = None

  def start(self, strategy=None, seed: Optional[int] = None) -> None:
    """Makes the generator (seeded with `seed`, tests only; else from OS
    entropy) and the step limit if they are missing: in `strategy`'s
    scope (so under a strategy they are distributed variables that work
    under XLA and on TPU), lifted out of any traced function."""
    if self.generator is not None and self.step_limit is not None:
      return
    scope = (strategy or tf.distribute.get_strategy()).scope()
    with scope, tf.init_scope():
      if self.generator is None:
        self.generator = dp_noise.make_generator(seed)
      if self.step_limit is None:
        self.step_limit = tf.Variable(
            NO_STEP_LIMIT, dtype=tf.int64, trainable=False,
            name="dp_step_limit")

  def take_over(self, previous: "StepState") -> None:
    """Continues `previous`'s run (a recompile with another optimizer):
    the same generator (a seeded stream goes on, never replays), step
    limit and last sampler. Its accumulators are not taken: `fit` starts
    every run with a fresh logical step."""
    if previous is self:
      return
    self.generator = previous.generator
    self.step_limit = previous.step_limit
    self.sampler = previous.sampler

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
