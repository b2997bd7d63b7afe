"""The micro-batch memory floor (shared/activation_memory.py): what surely cannot fit is refused
with a micro-batch that does; what fits is never refused."""
import pytest

from shared.activation_memory import GIB, activation_bytes, check_micro_batch_fits
from shared.run.config import PRESETS, ConfigError


def test_the_floor_is_linear_in_the_micro_batch_and_halved_by_bf16_in_the_layers():
    shape = PRESETS["andrea-12m"]
    one = activation_bytes(shape, 2305, 1, "fp32")
    assert activation_bytes(shape, 2305, 8, "fp32") == 8 * one
    assert activation_bytes(shape, 2305, 1, "bf16") < one
    # 6 layers x 34 x 384 x 2 bytes + 2 x 2305 x 4 per token, 1,024 tokens
    assert one == 1024 * (shape.n_layer * 34 * shape.n_embd * 2 + 2 * 2305 * 4)


def test_a_micro_batch_that_cannot_fit_is_refused_naming_one_that_does():
    shape = PRESETS["andrea-12m"]
    with pytest.raises(ConfigError) as e:
        check_micro_batch_fits(shape, 2305, 4096, 4096, "fp32", 1 * GIB, "cpu")
    msg = str(e.value)
    assert "4,096 sequences" in msg and "1.0 GiB of cpu" in msg and "--micro-batch-size" in msg
    m = int(msg.split("--micro-batch-size ")[1].split()[0])
    assert 4096 % m == 0 and activation_bytes(shape, 2305, m, "fp32") <= GIB // 2
    assert activation_bytes(shape, 2305, 2 * m, "fp32") > GIB // 2
    check_micro_batch_fits(shape, 2305, m, 4096, "fp32", 1 * GIB, "cpu")   # that one passes
    check_micro_batch_fits(shape, 2305, 10 ** 9, 10 ** 9, "fp32", None, "cpu")  # unknown: no check


def test_the_compiled_floor_is_lower_so_torch_compile_is_never_refused_what_fits_it():
    shape = PRESETS["andrea-12m"]
    assert activation_bytes(shape, 2305, 4, "bf16", compiled=True) < activation_bytes(shape, 2305, 4, "bf16")
