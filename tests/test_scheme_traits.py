"""Each scheme declares what it supports on its class; the settings, the kernels and torchft's rounds read it there."""

from __future__ import annotations

import pytest
import torch

from hf_flexdemo import FlexDeMo, FlexDeMoConfig, scheme_traits
from hf_flexdemo.schemes import SCHEME_CLASSES, Decoded, FullScheme, build_scheme
from hf_flexdemo.schemes.base import Collective

pytestmark = pytest.mark.unit


def test_every_named_scheme_declares_its_own_traits():
    for name, cls in SCHEME_CLASSES.items():
        assert "traits" in vars(cls), f"{cls.__name__} inherits its traits"
        assert scheme_traits.traits_of(name) is cls.traits
    assert scheme_traits.schemes_where("outer_steps") == ("diloco", "sparseloco")
    assert set(scheme_traits.schemes_where("per_step")) == {"demo", "random", "striding", "full"}


def test_each_schemes_traits_say_which_scheme_settings_it_reads():
    reads = {name: scheme_traits.traits_of(name).reads for name in SCHEME_CLASSES}
    assert reads["demo"] == {"topk", "chunk", "value_dtype"}
    assert reads["sparseloco"] == {"topk", "chunk", "inner_steps", "outer_lr", "outer_momentum", "value_dtype"}
    assert reads["diloco"] == {"inner_steps", "outer_lr", "outer_momentum", "value_dtype"}
    assert reads["random"] == {"rate", "seed", "value_dtype"} and reads["striding"] == {"rate", "value_dtype"}
    assert reads["full"] == {"value_dtype"} and reads["none"] == frozenset()
    assert all(read <= set(scheme_traits.SCHEME_SETTINGS) for read in reads.values())
    assert scheme_traits.schemes_reading("rate") == ("random", "striding")


@pytest.fixture
def halved():
    """A new scheme in one class: ``full`` that sends half the momentum; per step, not replayable, no top-k."""

    class HalvedScheme(FullScheme):
        name = "halved"
        traits = scheme_traits.SchemeTraits(per_step=True)
        collective = Collective.ALL_REDUCE

        def apply(self, bucket, received, ctx) -> Decoded | None:
            decoded = super().apply(bucket, received, ctx)
            return decoded and Decoded(bucket, decoded.update.mul_(0.5))

    yield HalvedScheme
    del scheme_traits._REGISTERED["halved"]  # other tests list the schemes in their messages


def test_a_scheme_defined_in_one_class_is_accepted_built_and_its_traits_checked(halved):
    config = FlexDeMoConfig(scheme="halved", replicate_every=2)
    assert type(build_scheme(config)) is halved and config.acting_settings()[:3] == ("scheme", "decay", "update")
    p = torch.nn.Parameter(torch.ones(4, 4))
    p.grad = torch.ones(4, 4)
    FlexDeMo([p], scheme="halved", elementwise=[]).step()
    assert not torch.equal(p.detach(), torch.ones(4, 4))
    with pytest.raises(ValueError, match=r"value_bits=2 applies to the top-k schemes \('demo', 'sparseloco'\)"):
        FlexDeMoConfig(scheme="halved", value_bits=2)
    with pytest.raises(ValueError, match="replay_steps=4 cannot apply to scheme='halved'"):
        FlexDeMoConfig(scheme="halved", fault_tolerance="torchft", replay_steps=4)
    with pytest.raises(ValueError, match="kernels='triton' fuses the passes of scheme='demo'"):
        FlexDeMoConfig(scheme="halved", kernels="triton")


def test_two_classes_that_claim_one_name_are_refused():
    with pytest.raises(RuntimeError, match="both call themselves scheme 'full'"):

        class AnotherFull(FullScheme):
            name = "full"
            traits = scheme_traits.SchemeTraits(per_step=True)
