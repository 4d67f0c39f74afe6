"""tf_pxg: per-example gradients and DP-SGD for TensorFlow 2 and Keras 3."""

from tf_pxg import rules  # noqa: F401  (registers the per-example rules)
from tf_pxg.registry import register
from tf_pxg.registry import registered_op_types
from tf_pxg.tape.gradient_tape import GradientTape

__all__ = ["GradientTape", "register", "registered_op_types"]
__version__ = "0.1.0"
