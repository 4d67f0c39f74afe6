"""Per-example rules, one module per op family, registered on import.

This is the one place that imports them all: to see which op types have a
rule, read this list (or call `tf_pxg.registry.registered_op_types()`).
"""

from tf_pxg.rules import base  # noqa: F401
from tf_pxg.rules import contraction  # noqa: F401
from tf_pxg.rules import elementwise  # noqa: F401
from tf_pxg.rules import gather  # noqa: F401
from tf_pxg.rules import conv  # noqa: F401
