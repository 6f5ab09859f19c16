"""optim.distributed: where it cannot work, the config and the trainer say what, where and how to fix."""

import pytest

from trainer.config import OptimConfig, RunConfig
from trainer.parallel.dist_optimizer import resolve_impl


@pytest.mark.parametrize("impl", ["apex", "torch_fused"])
def test_config_refuses_whole_parameter_impls(impl):
    with pytest.raises(ValueError) as e:
        RunConfig.from_dict({"optim": {"distributed": True, "impl": impl}})
    for w in ("optim.impl", impl, "optim.distributed", "auto, csrc, foreach or for_loop"):
        assert w in str(e.value)
    assert RunConfig.from_dict({"optim": {"impl": impl}}).optim.impl == impl  # fine without the option


def test_the_option_is_off_by_default_and_documented():
    assert OptimConfig().distributed is False
    assert RunConfig.from_dict({"optim": {"distributed": True}}).optim.distributed is True


def test_shard_step_implementation():
    assert resolve_impl("auto", "cpu", "auto") == "csrc"  # the compiled extension is built here
    assert resolve_impl("auto", "cpu", "eager") == "for_loop"
    assert resolve_impl("foreach", "cpu") == "foreach"
    with pytest.raises(ValueError, match="optim.impl=apex cannot step"):
        resolve_impl("apex", "cuda")
