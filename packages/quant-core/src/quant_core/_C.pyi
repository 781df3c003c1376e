# Stub of the private C++ extension (csrc/module.cpp). Pointers are integers (tensor.data_ptr()).
__version__: str

def amax(
    x_MK: int, dtype: int, M: int, K: int, stride_row: int, stride_col: int, amax_out: int, num_threads: int
) -> None: ...
def cast_to_fp8(
    x_MK: int,
    dtype: int,
    M: int,
    K: int,
    stride_row: int,
    stride_col: int,
    scale: int,
    fp8_format: int,
    rowwise_MK: int,
    columnwise_KM: int,
    num_threads: int,
) -> None: ...
