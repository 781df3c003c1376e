from __future__ import annotations

import dataclasses

import pytest
import torch

import quant_tensors as qt

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


@pytest.mark.parametrize(
    ("name", "cls"),
    [
        ("fp8", qt.Float8CurrentScaling),
        ("fp8-delayed", qt.Float8DelayedScaling),
        ("mxfp8", qt.MXFP8BlockScaling),
        ("fp8-block", qt.Float8BlockScaling),
        ("nvfp4", qt.NVFP4BlockScaling),
    ],
)
def test_recipe_from_name(name, cls):
    recipe = qt.recipe_from_name(name)
    assert type(recipe) is cls
    assert recipe == cls()
    assert recipe.name == name


def test_unknown_recipe_name_lists_the_choices():
    with pytest.raises(
        ValueError, match="unknown recipe 'fp16'; choose one of fp8, fp8-delayed, mxfp8, fp8-block, nvfp4"
    ):
        qt.recipe_from_name("fp16")


def test_recipes_are_frozen_and_keyword_only():
    recipe = qt.Float8CurrentScaling(fp8_format="e4m3", power_2_scales=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        recipe.power_2_scales = False  # type: ignore[misc]
    with pytest.raises(TypeError):
        qt.Float8CurrentScaling("e4m3")  # type: ignore[misc]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(fp8_format="e3m4"), "fp8_format must be one of"),
        (dict(amax_history_len=0), "amax_history_len must be >= 1"),
        (dict(amax_compute_algo="mean"), "amax_compute_algo must be 'max' or 'most_recent'"),
        (dict(margin=-1), "margin must be >= 0"),
    ],
)
def test_delayed_scaling_validates(kwargs, match):
    with pytest.raises(ValueError, match=match):
        qt.Float8DelayedScaling(**kwargs)


def test_bad_role_is_rejected():
    with pytest.raises(ValueError, match="role must be one of"):
        qt.MXFP8BlockScaling().quantizer("bias")  # type: ignore[arg-type]


@pytest.mark.parametrize("recipe", [qt.Float8CurrentScaling(), qt.Float8DelayedScaling(), qt.Float8BlockScaling()])
def test_hybrid_formats_per_role(recipe):
    assert recipe.quantizer("weight").fp8_dtype == E4M3
    assert recipe.quantizer("input").fp8_dtype == E4M3
    assert recipe.quantizer("grad_output").fp8_dtype == E5M2
    e4m3_only = dataclasses.replace(recipe, fp8_format="e4m3")
    assert {e4m3_only.quantizer(role).fp8_dtype for role in qt.ROLES} == {E4M3}


def test_block_shapes_per_role():
    blockwise, nvfp4 = qt.Float8BlockScaling(), qt.NVFP4BlockScaling()
    assert blockwise.quantizer("weight").block_shape == (128, 128)
    assert blockwise.quantizer("input").block_shape == (1, 128)
    assert blockwise.quantizer("grad_output").block_shape == (1, 128)
    assert nvfp4.quantizer("weight").block_shape == (16, 16)
    assert nvfp4.quantizer("input").block_shape == (1, 16)
    assert {qt.MXFP8BlockScaling().quantizer(role).block_shape for role in qt.ROLES} == {(1, 32)}


def test_nvfp4_rounds_only_gradients_stochastically():
    recipe = qt.NVFP4BlockScaling()
    assert [recipe.quantizer(role).stochastic_rounding for role in qt.ROLES] == [False, False, True]
    assert not qt.NVFP4BlockScaling(stochastic_rounding=False).quantizer("grad_output").stochastic_rounding


def test_delayed_scaling_quantizers_carry_the_recipe_settings():
    q = qt.Float8DelayedScaling(amax_history_len=4, amax_compute_algo="most_recent", margin=2).quantizer("input")
    assert (q.amax_history_len, q.amax_compute_algo, q.margin) == (4, "most_recent", 2)
    assert q.amax_history.shape == (4,)


@pytest.mark.parametrize("name", ["fp8", "fp8-delayed", "fp8-block", "nvfp4"])
def test_columnwise_on_demand_from_environment(monkeypatch, name):
    monkeypatch.setenv(qt.COLUMNWISE_ON_DEMAND_ENV_VAR, "1")
    recipe = qt.recipe_from_name(name)
    assert recipe.quantizer("weight").columnwise_on_demand
    assert not recipe.quantizer("input").columnwise_on_demand
    monkeypatch.setenv(qt.COLUMNWISE_ON_DEMAND_ENV_VAR, "0")
    assert not recipe.quantizer("weight").columnwise_on_demand


@pytest.mark.parametrize("name", ["fp8", "fp8-delayed", "fp8-block", "nvfp4"])
def test_weight_columnwise_on_demand_reaches_the_weight_quantizer(monkeypatch, name):
    recipe = qt.recipe_from_name(name)
    on = dataclasses.replace(recipe, weight_columnwise_on_demand=True)
    off = dataclasses.replace(recipe, weight_columnwise_on_demand=False)
    for environment in ("0", "1"):  # the field wins over the environment
        monkeypatch.setenv(qt.COLUMNWISE_ON_DEMAND_ENV_VAR, environment)
        assert on.quantizer("weight").columnwise_on_demand
        assert not off.quantizer("weight").columnwise_on_demand
        assert not any(on.quantizer(role).columnwise_on_demand for role in ("input", "grad_output"))
    assert on.quantizer("weight").quantize(torch.randn(128, 128)).usages == (True, False)


def test_weight_columnwise_on_demand_is_refused_where_columnwise_cannot_be_derived():
    with pytest.raises(
        ValueError,
        match=r"MXFP8BlockScaling\(weight_columnwise_on_demand=True\): MXFP8 weights quantize their columnwise "
        r"data separately .* leave weight_columnwise_on_demand unset or False, or use a recipe whose weights "
        r"derive it: fp8, fp8-delayed, fp8-block, nvfp4$",
    ):
        qt.MXFP8BlockScaling(weight_columnwise_on_demand=True)
    assert not qt.MXFP8BlockScaling(weight_columnwise_on_demand=False).quantizer("weight").columnwise_on_demand
    with pytest.raises(ValueError, match="fp8_format must be one of"):  # the recipe's own checks come first
        qt.Float8CurrentScaling(fp8_format="e3m4", weight_columnwise_on_demand=True)


def test_mxfp8_ignores_the_on_demand_environment(monkeypatch):
    # MXFP8's columnwise cannot be derived, so its weights always quantize both usages.
    monkeypatch.setenv(qt.COLUMNWISE_ON_DEMAND_ENV_VAR, "1")
    assert not qt.MXFP8BlockScaling().quantizer("weight").columnwise_on_demand
    with pytest.raises(ValueError, match="columnwise_on_demand needs columnwise data that is a lossless transpose"):
        qt.MXFP8Quantizer(columnwise_on_demand=True)


@pytest.mark.parametrize("name", ["fp8", "fp8-delayed", "mxfp8", "fp8-block", "nvfp4"])
def test_quantizes_like_means_equal_bytes_and_refuses_state(name):
    recipe = qt.recipe_from_name(name)
    a, b = recipe.quantizer("input"), recipe.quantizer("input")
    stateful = name == "fp8-delayed"
    assert a.stateless is not stateful
    assert a.quantizes_like(b) is not stateful
    assert not a.quantizes_like(a.with_usage(columnwise=not a.columnwise))
    # Gradients: E5M2 (fp8, fp8-block), stochastic rounding (nvfp4), a history (fp8-delayed);
    # MXFP8 quantizes inputs and gradients alike.
    assert a.quantizes_like(recipe.quantizer("grad_output")) is (name == "mxfp8")
    if a.quantizes_like(b):
        x = torch.randn(64, 128)
        qa, qb = a.quantize(x), b.quantize(x)
        for key, buffer in qa.buffers().items():
            assert (buffer is None) == (qb.buffers()[key] is None)
            if buffer is not None:
                assert torch.equal(
                    buffer.reshape(-1).view(torch.uint8), qb.buffers()[key].reshape(-1).view(torch.uint8)
                ), key
    assert recipe.quantizer("grad_output").stateless is (name not in ("nvfp4", "fp8-delayed"))


def test_encodes_like_compares_the_byte_layout_not_the_scales():
    fp8, delayed, mxfp8 = (qt.recipe_from_name(n) for n in ("fp8", "fp8-delayed", "mxfp8"))
    assert fp8.quantizer("input").encodes_like(delayed.quantizer("input"))  # both E4M3 per-tensor
    assert not fp8.quantizer("input").encodes_like(fp8.quantizer("grad_output"))  # E4M3 vs E5M2
    assert not qt.Float8BlockScaling().quantizer("input").encodes_like(qt.Float8BlockScaling().quantizer("weight"))
    assert not mxfp8.quantizer("input").encodes_like(fp8.quantizer("input"))
    assert mxfp8.quantizer("input").encodes_like(mxfp8.quantizer("grad_output"))


def test_fprop_fast_accumulation_defaults_and_refusals():
    # Off by default (the precision costs more than the step gains, [Note: fast accumulation]); a
    # per-tensor FP8 recipe takes True, a recipe whose GEMMs accumulate in fp32 refuses it and names the fix.
    for cls in (qt.Float8CurrentScaling, qt.Float8DelayedScaling):
        assert not cls().fprop_fast_accumulation
        assert cls(fprop_fast_accumulation=True).fprop_fast_accumulation
    for cls in (qt.MXFP8BlockScaling, qt.Float8BlockScaling, qt.NVFP4BlockScaling):
        assert not cls().fprop_fast_accumulation
        with pytest.raises(
            ValueError,
            match=rf"{cls.__name__}\(fprop_fast_accumulation=True\): its GEMMs have no fast-accumulation mode .* "
            r"leave it False, or use a per-tensor FP8 recipe",
        ):
            cls(fprop_fast_accumulation=True)
