"""Whether the code being traced will be compiled with XLA."""

import tensorflow as tf

from tf_pxg import _compat


def in_xla_context() -> bool:
  """True while tracing for XLA: inside a `jit_compile=True` function
  (possibly through nested functions) or a TPU replicate context. There
  only XLA-compilable ops may be used (no custom CPU ops), and rules may
  prefer other forms, since XLA schedules its own buffers and compiles
  loops differently. False when executing eagerly."""
  if tf.executing_eagerly():
    return False
  return _compat.graph_in_xla_context(tf.compat.v1.get_default_graph())
