"""The dtypes factors and inverses are kept in (shared by
:mod:`chainerkfac.linalg` and :mod:`chainerkfac.linalg_cuda`)."""
import numpy


def factor_dtype_for(array_dtype) -> numpy.dtype:
    """The dtype a factor is stored in: fp64 for an fp64 model, else fp32
    (whatever ``factor_dtype`` the products run in)."""
    if numpy.dtype(array_dtype) == numpy.float64:
        return numpy.dtype(numpy.float64)
    return numpy.dtype(numpy.float32)


#: ``factor_dtype`` for float32 factors from products on TF32 Tensor Cores
#: (operands with a 10-bit mantissa, fp32 sums): not a NumPy dtype.
TF32 = 'tf32'


def is_tf32(factor_dtype) -> bool:
    """Whether a ``factor_dtype`` option asks for TF32 products."""
    return isinstance(factor_dtype, str) and factor_dtype.lower() == TF32


def inverse_dtype(dtype) -> numpy.dtype:
    """The dtype an inverse is computed in: fp64 for fp64 factors, else fp32
    (never half precision)."""
    if numpy.dtype(dtype) == numpy.float64:
        return numpy.dtype(numpy.float64)
    return numpy.dtype(numpy.float32)
