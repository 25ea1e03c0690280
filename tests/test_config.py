"""Bad hyperparameters fail at construction, naming the setting, the value and what is allowed."""

from __future__ import annotations

import pytest
import torch

from hf_flexdemo import FlexDeMo, FlexDeMoConfig
from hf_flexdemo.config import OWN_KEYS, SHARED_KEYS, parse_optim_args

pytestmark = [pytest.mark.unit, pytest.mark.lowest]

BAD = [
    (dict(topk=0), "topk=0", "[1, 4096]"),
    (dict(topk=4097), "topk=4097", "at most chunk * chunk"),
    (dict(chunk=4, topk=17), "topk=17", "[1, 16]"),
    (dict(chunk=0), "chunk=0", ">= 1"),
    (dict(decay=1.0), "decay=1.0", "[0.0, 1.0)"),
    (dict(decay=-0.1), "decay=-0.1", "[0.0, 1.0)"),
    (dict(lr=-1e-3), "lr=-0.001", "[0.0, inf)"),
    (dict(weight_decay=-0.1), "weight_decay=-0.1", "[0.0, inf)"),
    (
        dict(scheme="sgd"),
        "scheme='sgd'",
        "'demo', 'full', 'none', 'diloco', 'sparseloco', 'random', 'striding'",
    ),
    (dict(replicate_every=0), "replicate_every=0", ">= 1"),
    (dict(scheme="diloco", replicate_every=2), "replicate_every=2", "inner_steps"),
    (dict(scheme="diloco", inner_steps=0), "inner_steps=0", ">= 1"),
    (dict(rate=0.0), "rate=0.0", "(0.0, 1.0]"),
    (dict(value_dtype="int8"), "value_dtype='int8'", "'param', 'bf16'"),
    (dict(topk=2.5), "topk=2.5", "integer"),
    (dict(outer_momentum=1.0), "outer_momentum=1.0", "[0.0, 1.0)"),
    (dict(scheme="diloco", betas=(0.9, 1.5)), "betas[1]=1.5", "[0.0, 1.0)"),
    (dict(value_bits=3), "value_bits=3", "(0, 1, 2, 4, 8)"),
    (dict(scheme="random", value_bits=1), "value_bits=1", "top-k schemes ('demo', 'sparseloco')"),
    (dict(scheme="sparseloco", replicate_every=2), "replicate_every=2", "inner_steps"),
    (dict(value_bits=1, rounding="stochastic"), "rounding='stochastic'", "value_bits 2, 4 or 8"),
    (dict(rounding="up"), "rounding='up'", "'nearest', 'stochastic'"),
    (dict(scheme="sparseloco", overlap=True), "overlap=True", "per-step schemes"),
    (dict(index_coding="huffman"), "index_coding='huffman'", "'fixed', 'elias_fano'"),
    (dict(index_coding="elias_fano"), "index_coding='elias_fano'", "set pack_indices=True as well"),
    (dict(scheme="random", index_coding="elias_fano"), "index_coding='elias_fano'", "drop index_coding"),
    (dict(ns_dtype="fp16"), "ns_dtype='fp16'", "'bf16', 'float32'"),
    (dict(update="sign", ns_dtype="float32"), "ns_dtype='float32'", "update='orthogonal'"),
    (dict(update="sign", ns_dtype="bf16"), "ns_dtype='bf16'", "update='orthogonal'"),
    # Outer-step schemes: AdamW inside, or the orthogonal rule's step (the rest keeps AdamW)
    (dict(scheme="diloco", update="adam"), "update='adam'", "set update='orthogonal' for Muon's inner step"),
    (dict(scheme="diloco", update="sign"), "update='sign' does not apply", "drop update, or write update='orthogonal'"),
    (dict(replay_steps=-1), "replay_steps=-1", ">= 0"),
    (dict(fault_tolerance="torchft", join_quorum="late"), "join_quorum='late'", "'before_forward', 'when_ready'"),
    (dict(join_quorum="when_ready"), "join_quorum='when_ready'", "fault_tolerance=torchft"),
    (dict(replay_steps=8), "replay_steps=8", "fault_tolerance=torchft"),
    (dict(fault_tolerance="torchft", stall_wait=-1.0), "stall_wait=-1.0", "[0.0, inf)"),
    (dict(stall_wait=2.0), "stall_wait=2", "fault_tolerance=torchft"),
    (dict(scheme="diloco", fault_tolerance="torchft", replay_steps=8), "replay_steps=8", "Drop replay_steps"),
    # a setting given at its default is still given: refused where it does not apply
    (dict(replay_steps=32), "replay_steps=32", "fault_tolerance=torchft"),
    (dict(join_quorum="before_forward"), "join_quorum='before_forward'", "fault_tolerance=torchft"),
    (dict(stall_wait=5.0), "stall_wait=5", "fault_tolerance=torchft"),
    (dict(scheme="diloco", fault_tolerance="torchft", replay_steps=32), "replay_steps=32", "Drop replay_steps"),
    # the outer-step schemes' momenta are betas[0] and outer_momentum: decay would be ignored, even at DeMo's value
    (dict(scheme="diloco", decay=0.9), "decay=0.9", "per-step schemes ('demo'"),
    (dict(scheme="sparseloco", decay=0.999), "decay=0.999", "Drop decay"),
    # codes and float32 scales travel: the dtype of plain values would be ignored
    (dict(value_bits=2, value_dtype="bf16"), "value_dtype='bf16'", "value_bits=0"),
    (dict(scheme="sparseloco", value_bits=1, value_dtype="fp32"), "value_dtype='fp32'", "Drop value_dtype"),
    (dict(wire="2bit", value_dtype="param"), "value_dtype='param'", "Drop value_dtype"),  # at its default: given
    # the scheme's own refusal of value_bits speaks first: it is what to change
    (dict(scheme="random", value_bits=2, value_dtype="bf16"), "value_bits=2", "use value_dtype='bf16'"),
    # a tile's share of the top-k: only the top-k schemes pick one
    (dict(scheme="full", scale_topk=True), "scale_topk=True", "drop scale_topk"),
    (dict(scale_topk="yes"), "scale_topk='yes'", "True or False"),
    # a setting only some schemes read is refused on the others whatever its value, naming the ones that read it
    (dict(inner_steps=7), "inner_steps=7 applies to the schemes 'diloco', 'sparseloco'", "write scheme=diloco"),
    (dict(scheme="full", inner_steps=100), "inner_steps=100", "not scheme='full'"),
    (dict(outer_lr=0.5), "outer_lr=0.5 applies to the schemes 'diloco', 'sparseloco'", "drop outer_lr"),
    (dict(scheme="random", outer_momentum=0.9), "outer_momentum=0.9", "not scheme='random'"),
    (dict(rate=0.5), "rate=0.5 applies to the schemes 'random', 'striding'", "write scheme=random"),
    (dict(scheme="diloco", rate=1 / 128), "rate=0.0078125", "not scheme='diloco'"),
    (dict(seed=3), "seed=3 applies to the scheme 'random'", "drop seed"),
    (dict(scheme="striding", seed=0), "seed=0", "not scheme='striding'"),
    (dict(scheme="full", topk=32), "topk=32 applies to the schemes 'demo', 'sparseloco'", "not scheme='full'"),
    (dict(scheme="diloco", chunk=64), "chunk=64 applies to the schemes 'demo', 'sparseloco'", "drop chunk"),
    (dict(scheme="none", value_dtype="param"), "value_dtype=param", "not scheme='none'"),
    (dict(sign=True), "sign=True applies to update='sign'", "update='orthogonal' (the default on scheme='demo')"),
    (dict(update="adam", sign=False), "sign=False applies to update='sign'", "write update=sign"),
    (dict(scheme="diloco", sign=True), "sign=True", "its inner AdamW"),
    # taken out: the message says so, why, and where the finding and the code are
    (dict(topk_block=2), "topk_block was removed", "17d8727"),
    (dict(derived_topk=8), "derived_topk was removed", "BENCHMARKS.md, 'Findings: options taken out'"),
    (dict(factor_rank=2), "factor_rank was removed", "17d8727"),
    (dict(ns_steps=5), "ns_steps was removed", "Muon's five"),
    (dict(elementwise_update="adam"), "elementwise_update was removed", "update='adam' or 'sign'"),
    (dict(decode="selected"), "decode was removed", "17d8727"),
    (dict(shared_indices=True), "shared_indices was removed", "+9.8% against it"),
    (dict(scheme="lowrank"), "scheme=lowrank was removed", "17d8727"),
    (dict(wire="top144_c128_2bit"), "wire=top144_c128_2bit was removed", "wire=2bit"),
    (dict(wire="top16_2bit"), "wire=top16_2bit was removed", "wire=2bit or wire=top4_1bit"),
    (dict(wire="top24_2bit"), "wire=top24_2bit was removed", "commit a3f78d8"),
]


@pytest.mark.parametrize("kwargs,value,allowed", BAD)
def test_bad_hyperparameter_is_refused_by_the_optimizer(kwargs, value, allowed):
    with pytest.raises(ValueError) as err:
        FlexDeMo([torch.nn.Parameter(torch.zeros(4))], **kwargs)
    assert value in str(err.value) and allowed in str(err.value)


@pytest.mark.parametrize("kwargs,value,allowed", BAD[:8])
def test_bad_hyperparameter_in_a_param_group_is_refused(kwargs, value, allowed):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(4))], **kwargs}]
    if "chunk" in kwargs and "topk" not in kwargs:
        groups[0]["topk"] = 1
    with pytest.raises(ValueError) as err:
        FlexDeMo(groups)
    assert value in str(err.value)


@pytest.mark.parametrize("scheme", ["diloco", "sparseloco"])
def test_a_momentum_decay_in_a_parameter_group_of_an_outer_step_scheme_is_refused(scheme):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(4))], "decay": 0.95}]
    with pytest.raises(ValueError, match=r"decay=0.95 in a parameter group is .* would ignore it"):
        FlexDeMo(groups, scheme=scheme)
    assert FlexDeMo(groups, scheme="demo").param_groups[0]["decay"] == 0.95
    unset = [{"params": [torch.nn.Parameter(torch.zeros(4))], "decay": None}]  # as FlexDeMo(decay=None)
    assert FlexDeMo(unset, scheme=scheme).param_groups[0]["decay"] == 0.999
    assert FlexDeMo(unset, scheme="demo", decay=0.9).param_groups[0]["decay"] == 0.9


@pytest.mark.parametrize(
    ("key", "value"), [("outer_momentum", 0.8), ("scheme", "full"), ("value_bits", 2), ("inner_steps", 4)]
)
def test_a_setting_of_the_whole_optimizer_in_a_parameter_group_is_refused_not_ignored(key, value):
    groups = [{"params": [torch.nn.Parameter(torch.zeros(4))]}, {"params": [torch.nn.Parameter(torch.zeros(4))]}]
    groups[1][key] = value
    with pytest.raises(ValueError) as err:
        FlexDeMo(groups, scheme="sparseloco")
    message = str(err.value)
    assert f"{key}={value!r} in a parameter group; it holds for the whole optimizer" in message
    assert "pass it to FlexDeMo(...) (or optim_args) instead" in message and "a group may set lr, " in message


def test_a_group_keeps_keys_that_are_no_setting_as_torch_optimizers_do():
    group = {"params": [torch.nn.Parameter(torch.zeros(4))], "name": "embeddings", "lr": 1e-3}
    assert FlexDeMo([group]).param_groups[0]["name"] == "embeddings"


def test_an_unset_momentum_decay_is_demos_and_an_outer_step_scheme_runs_without_one():
    assert FlexDeMoConfig().decay == FlexDeMoConfig(scheme="diloco").decay == 0.999
    assert FlexDeMoConfig.from_optim_args("scheme=sparseloco,outer_momentum=0.9").outer_momentum == 0.9
    with pytest.raises(ValueError, match="decay=0.99 "):
        FlexDeMoConfig.from_optim_args("scheme=sparseloco,decay=0.99")
    assert FlexDeMoConfig.from_optim_args("decay=0.99").decay == 0.99


def test_optim_args_are_parsed_with_types():
    config = FlexDeMoConfig.from_optim_args("seed=7, sign=false,rate=1/64,betas=0.9:0.95,scheme=random")
    assert (config.seed, config.sign, config.rate, config.betas, config.scheme) == (7, False, 1 / 64, (0.9, 0.95), "random")
    assert (FlexDeMoConfig.from_optim_args("topk=4, chunk=16").topk, config.topk) == (4, 32)  # unset: resolved


@pytest.mark.parametrize(
    "text,message",
    [
        ("topk=4,colour=red", "unknown key 'colour'"),
        ("topk=four", "topk='four' is not int"),
        ("sign=maybe", "sign='maybe' is not bool"),
        ("topk", "not of the form key=value"),
        ("topk=0", "topk=0 is invalid"),
    ],
)
def test_bad_optim_args_are_refused(text, message):
    with pytest.raises(ValueError) as err:
        FlexDeMoConfig.from_optim_args(text)
    assert message in str(err.value)


def test_a_near_miss_key_is_named_and_the_list_holds_only_keys_optim_args_accepts():
    with pytest.raises(ValueError) as err:
        parse_optim_args("top_k=32")
    message = str(err.value)
    assert "unknown key 'top_k' (did you mean 'topk'? write topk=32)" in message
    listed = message.partition("The keys are ")[2].partition("]")[0]
    assert "'topk'" in listed and not any(f"'{key}'" in listed for key in SHARED_KEYS), message
    assert "--learning_rate" in message  # where lr and the others go instead


def test_semicolons_are_refused_with_the_comma_separated_form():
    with pytest.raises(ValueError, match="separated by commas, not semicolons; write 'topk=32,chunk=64'"):
        parse_optim_args("topk=32;chunk=64")


def test_a_key_given_twice_is_refused_with_both_values():
    with pytest.raises(ValueError, match=r"topk is given twice \(topk=32 and topk=16\)"):
        parse_optim_args("topk=32,chunk=64,topk=16")


def test_a_space_where_a_comma_belongs_is_refused_with_the_text_read_and_the_comma_form():
    expected = "separated by commas; 'chunk=64 topk=32' reads as one setting. Write 'chunk=64,topk=32'"
    with pytest.raises(ValueError, match=expected):
        parse_optim_args("chunk=64 topk=32")
    assert parse_optim_args(" topk = 32 , chunk=64") == {"topk": 32, "chunk": 64}  # spaces around a setting are fine


def test_every_flexdemo_only_setting_is_refused_with_another_optimizer():
    # A key missing here would be dropped silently by --optim adamw_torch --optim_args ...
    assert set(OWN_KEYS) | set(SHARED_KEYS) == set(FlexDeMoConfig.field_names())
    assert {"decay", "sign", "seed", "topk", "fault_tolerance"} <= set(OWN_KEYS)
    assert not set(OWN_KEYS) & set(SHARED_KEYS)


def test_a_torchft_node_protects_the_others_from_a_slow_node_by_default():
    torchft = FlexDeMoConfig(fault_tolerance="torchft")
    assert (torchft.join_quorum, torchft.replay_steps, torchft.stall_wait) == ("when_ready", 32, 5.0)
    chosen = FlexDeMoConfig.from_optim_args("fault_tolerance=torchft,join_quorum=before_forward,replay_steps=4")
    assert (chosen.join_quorum, chosen.replay_steps) == ("before_forward", 4)
    alone = FlexDeMoConfig()  # nothing to protect: no quorum, nothing kept for replay
    assert (alone.join_quorum, alone.replay_steps, alone.stall_wait) == ("before_forward", 0, 0.0)


def test_parse_empty_optim_args():
    assert parse_optim_args(None) == {} and parse_optim_args("") == {}


def test_adam_betas_matter_only_where_an_adam_rule_reads_them():
    # The Trainer passes --adam_beta1/2 to every scheme; DiLoCo's inner AdamW and the adam rules read them.
    FlexDeMo([torch.nn.Parameter(torch.zeros(4))], scheme="demo", update="sign", betas=(0.9, 1.0))
    FlexDeMo([torch.nn.Parameter(torch.zeros(4))], scheme="random", betas=(0.9, 1.0))  # its default rule: sign
    for kwargs in (dict(scheme="diloco"), dict(scheme="demo")):  # demo's default rule: orthogonal, adam for the rest
        with pytest.raises(ValueError, match=r"betas\[1\]=1.0 is invalid"):
            FlexDeMo([torch.nn.Parameter(torch.zeros(4))], betas=(0.9, 1.0), **kwargs)


def test_a_fraction_with_a_zero_denominator_is_refused_clearly():
    with pytest.raises(ValueError, match=r"rate='1/0' divides by zero; write a fraction like 1/128"):
        parse_optim_args("scheme=random,rate=1/0")


@pytest.mark.parametrize(
    "kwargs,acting,ignored",
    [
        (dict(), ["update", "topk"], ["sign", "rate"]),  # orthogonal: sign is unread
        (dict(update="adam"), ["update", "topk"], ["sign"]),
        (dict(update="sign", sign=False), ["update", "sign"], ["rate"]),
        (dict(scheme="full"), ["update", "value_dtype"], ["topk", "chunk", "sign"]),
        (dict(scheme="random"), ["rate", "sign"], ["topk", "chunk"]),
        (dict(scheme="none"), ["decay", "update"], ["value_dtype", "replicate_every", "topk"]),
        (dict(scheme="diloco"), ["inner_steps", "outer_lr"], ["decay", "update", "sign", "topk"]),
        (dict(scheme="sparseloco", update="orthogonal"), ["update", "topk"], ["decay"]),
        (dict(ns_dtype="float32"), ["update", "ns_dtype"], ["sign"]),
        (dict(ns_dtype="bf16"), ["update", "ns_dtype"], ["sign"]),
        (dict(ns_dtype="auto"), ["update"], ["ns_dtype"]),  # the default, by device, goes unsaid
        (dict(value_bits=2), ["value_bits", "replicate_every"], ["value_dtype"]),  # codes: no value dtype
        (dict(scheme="sparseloco", value_bits=2), ["value_bits", "outer_momentum"], ["value_dtype", "decay"]),
        (dict(value_dtype="bf16"), ["value_dtype"], ["value_bits"]),
        (dict(scale_topk=True), ["topk", "chunk", "scale_topk"], ["rate"]),
        (dict(), ["topk"], ["scale_topk"]),
    ],
)
def test_a_summary_lists_the_settings_that_act(kwargs, acting, ignored):
    keys = FlexDeMoConfig(**kwargs).acting_settings()
    assert set(acting) <= set(keys) and not set(ignored) & set(keys), keys


def test_a_wire_preset_sets_its_knobs_and_refuses_a_knob_that_disagrees():
    from hf_flexdemo.config import NAMED_WIRES, WIRE_PRESETS, parse_optim_args

    for name, knobs in NAMED_WIRES.items():
        config = FlexDeMoConfig.from_optim_args(f"wire={name}")
        assert {key: getattr(config, key) for key in knobs} == knobs
    assert FlexDeMoConfig(wire="2bit", topk=32).topk == 32  # a knob that agrees is fine
    with pytest.raises(ValueError, match=r"wire='top64_1bit' sets topk=64, but topk=16 is given too; drop topk"):
        FlexDeMoConfig(wire="top64_1bit", topk=16)
    # In optim_args a knob given at its default is still given: refused, not silently replaced.
    with pytest.raises(ValueError, match=r"wire='top64_1bit' sets topk=64, but topk=32 is given too"):
        parse_optim_args("wire=top64_1bit,topk=32")
    with pytest.raises(ValueError, match=r"wire='top64_1bit' sets topk=64, but topk=32 is given too"):
        FlexDeMoConfig(wire="top64_1bit", topk=32)  # topk is None until given: 32 written is 32 meant
    # So in FlexDeMo(...)'s keywords: written beside the preset, a default value was meant, not to be replaced.
    with pytest.raises(ValueError, match=r"FlexDeMo: wire='top64_1bit' sets topk=64, but topk=32 is given too"):
        FlexDeMo([torch.nn.Parameter(torch.zeros(4))], wire="top64_1bit", topk=32)
    # The presets: the frontier of bytes against a whole run's loss, at most 5; demo names DeMo's own wire
    assert list(WIRE_PRESETS) == ["top128_4bit", "top96_2bit", "top64_1bit", "2bit", "top4_1bit"]
    allowed = r"wire must be one of \('demo', 'top128_4bit', 'top96_2bit', 'top64_1bit', '2bit', 'top4_1bit'\)"
    with pytest.raises(ValueError, match=r"wire='fast' is invalid; " + allowed):
        FlexDeMoConfig(wire="fast")
    with pytest.raises(ValueError, match=r"wire='2bit' names a format of scheme='demo', not scheme='diloco'"):
        FlexDeMoConfig(wire="2bit", scheme="diloco")
    with pytest.raises(ValueError, match=r"own knobs \(topk, value_bits, pack_indices and index_coding\)"):
        FlexDeMoConfig(wire="top96_2bit", scheme="sparseloco")
    opt = FlexDeMo([torch.nn.Parameter(torch.zeros(64, 64))], wire="top4_1bit", elementwise=[])
    assert opt.param_groups[0]["topk"] == 4 and opt.config.value_bits == 1 and opt.config.pack_indices


def test_every_setting_belongs_to_one_group_and_each_group_checks_its_own_values():
    import dataclasses

    from hf_flexdemo.config import SETTING_GROUPS

    names = [f.name for group in SETTING_GROUPS for f in dataclasses.fields(group)]
    assert len(names) == len(set(names)) and set(names) == set(FlexDeMoConfig.field_names())
    assert all(issubclass(FlexDeMoConfig, group) for group in SETTING_GROUPS)
    with pytest.raises(ValueError, match=r"index_coding='gamma' is invalid"):  # the wire's own check
        FlexDeMoConfig(index_coding="gamma")
    with pytest.raises(ValueError, match=r"index_coding='elias_fano' codes the indices of the top-k schemes"):
        FlexDeMoConfig(scheme="full", index_coding="elias_fano")  # the wire against the scheme: named first
    with pytest.raises(TypeError):
        FlexDeMoConfig(1e-3)  # keywords only: a positional value cannot land in the wrong field


def test_the_optimizer_takes_every_setting_by_name_and_names_the_closest_one_to_a_typo():
    param = torch.nn.Parameter(torch.zeros(8, 8))
    opt = FlexDeMo([param], lr=0.25, topk=4, chunk=8, scheme="sparseloco", elementwise=[])
    assert (opt.config.lr, opt.config.topk, opt.config.scheme, opt.defaults["lr"]) == (0.25, 4, "sparseloco", 0.25)
    with pytest.raises(TypeError, match=r"'topK' is no setting \(did you mean 'topk'\?\)"):
        FlexDeMo([param], topK=4)


def test_the_settings_are_few_with_short_help_and_the_common_ones_named_first():
    import dataclasses

    from hf_flexdemo.config import ADVANCED_WIRE_SETTINGS, COMMON_SETTINGS

    fields = dataclasses.fields(FlexDeMoConfig)
    assert len(fields) <= 35
    long = {f.name: len(f.metadata["help"]) for f in fields if len(f.metadata["help"]) > 300}
    assert not long, f"help of at most 3 lines (300 characters); explanations belong in the guides: {long}"
    assert len(COMMON_SETTINGS) <= 10 and not set(COMMON_SETTINGS) & set(ADVANCED_WIRE_SETTINGS)
    assert set(COMMON_SETTINGS) | set(ADVANCED_WIRE_SETTINGS) <= set(FlexDeMoConfig.field_names())


@pytest.mark.parametrize(
    "text, commit",
    [(text, "17d8727") for text in ("topk_block=2", "derived_topk=8", "factor_rank=1", "ns_steps=5", "decode=mean")]
    + [("shared_indices=true", "74cba10")],
)
def test_a_removed_setting_in_optim_args_says_it_was_removed_why_and_where(text, commit):
    key = text.partition("=")[0]
    with pytest.raises(ValueError) as err:
        parse_optim_args(f"topk=32,{text}")
    message = str(err.value)
    assert message.startswith(f"FlexDeMo optim_args: {key} was removed: ")
    assert f"The finding: BENCHMARKS.md, 'Findings: options taken out'; the code: commit {commit}." in message
    assert f"Instead, drop {key}" in message


def test_the_removed_settings_have_one_table():
    from hf_flexdemo.removed import REMOVED_SETTINGS, REMOVED_VALUES

    assert set(REMOVED_SETTINGS).isdisjoint(FlexDeMoConfig.field_names())
    for (key, value), (why, instead) in REMOVED_VALUES.items():
        assert key in FlexDeMoConfig.field_names() and why and instead
        with pytest.raises(ValueError, match=rf"FlexDeMo: {key}={value} was removed: "):
            FlexDeMoConfig(**{key: value})
