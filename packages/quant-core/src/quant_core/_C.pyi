# Stub of the private C++ extension (csrc/module.cpp). Pointers are integers (tensor.data_ptr()).
__version__: str

def amax(
    x_MK: int, dtype: int, M: int, K: int, stride_row: int, stride_col: int, amax_out: int, num_threads: int
) -> None: ...
def amax_many(
    x_MKs: list[int],
    dtypes: list[int],
    Ms: list[int],
    Ks: list[int],
    stride_rows: list[int],
    stride_cols: list[int],
    amax_out: int,
    num_threads: int,
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
def fp8_scale(
    amax: int, n: int, fmax: float, margin: int, power_2_scales: bool, scale: int, scale_inv: int
) -> None: ...
def delayed_fp8_scale(
    amax_history: int,
    length: int,
    amax: int,
    fmax: float,
    margin: int,
    power_2_scales: bool,
    most_recent: bool,
    scale: int,
    scale_inv: int,
) -> None: ...

class AdamScalars:
    def __init__(
        self,
        decay: float,
        weight_decay: float,
        beta1: float,
        one_minus_beta1: float,
        beta2: float,
        one_minus_beta2: float,
        inv_bias_correction2_sqrt: float,
        eps: float,
        step_size: float,
    ) -> None: ...

def adam_step(
    params: list[int],
    grads: list[int],
    exp_avgs: list[int],
    exp_avg_sqs: list[int],
    numels: list[int],
    grad_dtype: int,
    exp_avg_dtype: int,
    exp_avg_sq_dtype: int,
    scalars: AdamScalars,
    amax_out: int,
    counters: list[int],
    seed: int,
    scale_invs: list[int],
    moment_amaxes: int,
    num_threads: int,
) -> None: ...
def adam_moment_amaxes(
    params: list[int],
    grads: list[int],
    exp_avgs: list[int],
    exp_avg_sqs: list[int],
    numels: list[int],
    param_dtype: int,
    grad_dtype: int,
    exp_avg_dtype: int,
    exp_avg_sq_dtype: int,
    scalars: AdamScalars,
    scale_invs: list[int],
    amax_out: int,
    num_threads: int,
) -> None: ...
def has_non_finite(tensors: list[int], dtypes: list[int], numels: list[int], num_threads: int) -> bool: ...
