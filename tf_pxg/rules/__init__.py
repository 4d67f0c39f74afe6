"""Per-example rules, one module per op family, registered on import.

This is the one place that imports them all: to see which op types have a
rule, read this list (or call `tf_pxg.registered_op_types()`). Importing
this package (`tf_pxg.register`, the engine) registers them; the registry
(`tf_pxg.registry`) imports no rule.
"""

from tf_pxg.rules import base  # noqa: F401
from tf_pxg.rules import contraction  # noqa: F401
from tf_pxg.rules import elementwise  # noqa: F401
from tf_pxg.rules import gather  # noqa: F401
from tf_pxg.rules import conv  # noqa: F401
from tf_pxg.rules import copies  # noqa: F401
from tf_pxg.registry import registered_op_types  # noqa: F401
from tf_pxg.rules.base import register  # noqa: F401
