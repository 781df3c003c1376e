"""Debug: the fused FP8 quantize's amax on fp16 (300, 520) x.t(), fast launches on and off."""
import torch
import quant_core
from quant_core import _triton_fp8, _triton_launch
from quant_core.testing import adversarial

x = adversarial((300, 520), torch.float16, seed=821).cuda()
want = quant_core.amax_reference(x.cpu()).item()
for fast in (True, False):
    _triton_launch._compiled.clear()
    if not fast:
        _triton_launch._INTERPRETED = True  # every launch takes Triton's normal path
    for view in (x, x.t(), x.t(), x):
        for columnwise in (False, True):
            got = quant_core.quantize_fp8(view, power_2_scales=True, rowwise=not columnwise, columnwise=columnwise)
            p = _triton_fp8._launch_amax(view.reshape(-1, view.shape[-1]) if view.is_contiguous() else view, None, 256)
            torch.cuda.synchronize()
            print(f"fast={fast} contiguous={view.is_contiguous()} columnwise={columnwise}: amax {got.amax.item()} partials max {p.max().item()} n={p.numel()} want {want}")
