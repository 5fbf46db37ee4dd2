"""CompilationConfig: presets, CLI parsing, and start-up errors that list the valid choices."""

import pytest

from kiln.compile.config import (COMPILATION_LEVELS, CompilationConfig, compilation_config_from_dict,
                                 parse_compilation_args)


def test_defaults_are_level_2():
    rest, config = parse_compilation_args(["generate", "hello"])
    assert rest == ["generate", "hello"]
    assert config == CompilationConfig.level(2)
    assert config.mode == 3 and config.piece_compiler == "inductor" and config.strategy == "lazy"


@pytest.mark.parametrize("level", sorted(COMPILATION_LEVELS))
def test_levels(level):
    _, config = parse_compilation_args([f"-O{level}"])
    assert config == CompilationConfig.level(level)
    _, spaced = parse_compilation_args(["-O", str(level)])
    assert spaced == config


def test_o0_is_eager_and_o3_compiles_ahead():
    assert CompilationConfig.level(0).mode == 0
    o3 = CompilationConfig.level(3)
    assert o3.mode == 3 and o3.strategy == "eager" and o3.compile_sizes


def test_cc_keys_override_the_level_whatever_the_order():
    rest, config = parse_compilation_args(["-cc.strategy=eager", "-O2", "serve", "-cc.compile_sizes=1,2,4",
                                           "-cc.compile_ranges=[16, 256]", "-cc.debug_guards=true"])
    assert rest == ["serve"]
    assert config.strategy == "eager" and config.compile_sizes == [1, 2, 4]
    assert config.compile_ranges == [16, 256] and config.debug_guards is True


def test_json_config_and_mode():
    _, config = parse_compilation_args(["--compilation-config", '{"mode": 2, "backend": "aot_eager"}'])
    assert config.mode == 2 and config.backend == "aot_eager"
    _, config = parse_compilation_args(['--compilation-config={"splitting_ops": ["aten::mm"]}', "-cc.mode=3"])
    assert config.splitting_ops == ["aten::mm"] and config.mode == 3


def test_enforce_eager():
    _, config = parse_compilation_args(["--enforce-eager"])
    assert config.mode == 0
    with pytest.raises(ValueError, match="contradicts"):
        parse_compilation_args(["--enforce-eager", "-O3"])
    with pytest.raises(ValueError, match="contradicts"):
        parse_compilation_args(["--enforce-eager", "-cc.mode=2"])


def test_unknown_key_lists_valid_keys():
    with pytest.raises(ValueError, match="unknown compilation config key.*valid: mode, backend, piece_compiler"):
        parse_compilation_args(["-cc.moed=3"])
    with pytest.raises(ValueError, match="valid:.*strategy"):
        parse_compilation_args(["--compilation-config", '{"stratgy": "eager"}'])


@pytest.mark.parametrize("argv, message", [
    (["-cc.mode=7"], r"mode must be one of \(0, 1, 2, 3\)"),
    (["-cc.strategy=sometimes"], "strategy must be one of eager, lazy"),
    (["-cc.piece_compiler=tvm"], "piece_compiler must be one of inductor, eager"),
    (["-cc.dynamic_shapes_mark=maybe"], "dynamic_shapes_mark must be one of backed, unbacked"),
    (["-cc.compile_sizes=4,2"], "strictly increasing"),
    (["-cc.compile_ranges=0,8"], "positive integers"),
    (["-cc.debug_guards=perhaps"], "true or false"),
    (["-cc.mode=2", "-cc.backend=nope"], "backend 'nope' is unknown; valid: .*inductor"),
    (["-O9"], "-O9 is unknown; valid: -O0, -O1, -O2, -O3"),
    (["-Ofast"], "-O takes a level"),
    (["-cc.mode"], "-cc.<key>=<value>"),
    (["--compilation-config", "{mode: 3}"], "JSON object"),
    (['-cc.inductor_compile_config={"emulate_precision_cast": false}'],
     "'emulate_precision_cast' is not a torch._inductor.config setting"),
    (['-cc.inductor_compile_config={"graph_partition": true}'], "kiln sets from compilation splitting_mode"),
    (["-cc.inductor_compile_config=[1]"], "must be a JSON object of torch._inductor.config settings"),
])
def test_bad_values_fail_at_start_up(argv, message):
    with pytest.raises(ValueError, match=message):
        parse_compilation_args(argv)


def test_inductor_settings_round_as_eager_unless_told_otherwise():
    assert CompilationConfig.level(2).inductor_settings() == {"emulate_precision_casts": True}
    _, config = parse_compilation_args(['-cc.inductor_compile_config={"emulate_precision_casts": false, '
                                        '"max_autotune": true}'])
    assert config.inductor_settings() == {"emulate_precision_casts": False, "max_autotune": True}


def test_uses_inductor():
    assert CompilationConfig(mode=3).uses_inductor
    assert not CompilationConfig(mode=3, piece_compiler="eager").uses_inductor
    assert CompilationConfig(mode=1).uses_inductor
    assert not CompilationConfig(mode=2, backend="eager").uses_inductor
    assert not CompilationConfig(mode=0).uses_inductor


def test_from_dict_keeps_typed_values():
    config = compilation_config_from_dict({"compile_sizes": [1, 8], "mode": 3}, level=1)
    assert config.compile_sizes == [1, 8] and config.piece_compiler == "eager"


def test_engine_refuses_debug_guards_that_every_decode_step_would_fail():
    from kiln.config import EngineConfig

    with pytest.raises(ValueError, match="add -cc.dynamic_shapes_mark=unbacked"):
        EngineConfig(model="tiny-llama", device="cpu", compilation=CompilationConfig(mode=3, debug_guards=True))
    EngineConfig(model="tiny-llama", device="cpu",
                 compilation=CompilationConfig(mode=3, debug_guards=True, dynamic_shapes_mark="unbacked"))
