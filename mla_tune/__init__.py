"""mla-tune: autotune MLA decode kernels, keep the winners, dispatch to them."""

from mla_tune.problem import KVFormat, Shape, generate_input, parse_shape

__version__ = "0.1.0"

__all__ = ["KVFormat", "Shape", "__version__", "generate_input", "parse_shape"]
