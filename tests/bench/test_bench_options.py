"""The benchmarks' command lines come from their options dataclasses
(bench/harness/options.py): defaults from the fields, values parsed into them."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from bench.cli import bench
from bench.harness.options import build, internal, opt, options_command


@pytest.mark.parametrize("name", sorted(bench.commands))
def test_every_command_defaults_to_its_dataclass(name: str) -> None:
    command = bench.commands[name]
    ctx = command.make_context(name, [])
    # The wrapped function's options class: what a run with no flags builds.
    func = command.callback.__wrapped__  # type: ignore[union-attr]
    cls = func.__globals__[func.__annotations__["options"]]
    assert build(cls, ctx.params) == cls()
    assert CliRunner().invoke(bench, [name, "--help"]).exit_code == 0


def _pairs(values: tuple[str, ...]) -> dict[str, str]:
    return dict(value.split("=", 1) for value in values)


@dataclass(slots=True)
class FooOptions:
    model: str = "default"
    prompt_len: tuple[int, int] = opt((20, 400), "min-max tokens")
    modes: tuple[str, ...] = opt(("a", "b"), flag="--mode", choices=("a", "b", "c"))
    sizes: tuple[int, ...] = (1, 2)
    duration_s: float | None = opt(None, "seconds")
    ignore_eos: bool = True
    quick: bool = False
    names: dict[str, str] = opt({}, flag="--name", parse=_pairs)
    serve_args: list[str] = opt(["--x", "1"], "extra flag", flag="--serve-arg")
    output: Path | None = None
    hidden: int = internal(7)
    only_here: int = 3

    def validate(self) -> None:
        if self.prompt_len[1] > 1000:
            raise ValueError("--prompt-len is at most 1000")


@click.command()
@options_command(FooOptions, exclude=("only_here",))
def foo(options: FooOptions) -> None:
    print(repr(options))


def _run(*args: str) -> FooOptions:
    result = CliRunner().invoke(foo, list(args))
    assert result.exit_code == 0, result.output
    namespace = {"FooOptions": FooOptions, "PosixPath": Path}
    built: FooOptions = eval(result.output.strip(), namespace)
    return built


def test_a_command_builds_its_dataclass_from_the_flags() -> None:
    assert _run() == FooOptions()
    got = _run("--model", "m", "--prompt-len", "5-9", "--mode", "c", "--mode", "a",
               "--sizes", "4", "--duration", "2.5", "--no-ignore-eos", "--quick",
               "--name", "a=b", "--name", "c=d=e", "--serve-arg", "--y 2 --z",
               "--output", "out.json")
    assert got == FooOptions(
        model="m", prompt_len=(5, 9), modes=("c", "a"), sizes=(4,), duration_s=2.5,
        ignore_eos=False, quick=True, names={"a": "b", "c": "d=e"},
        serve_args=["--y", "2", "--z"], output=Path("out.json"),
    )
    # A mutable default is the options' own: one run's list is not the next one's.
    assert FooOptions().serve_args is not FooOptions().serve_args


def test_bad_values_internal_and_excluded_fields_are_usage_errors() -> None:
    runner = CliRunner()
    for args, message in (
        (["--prompt-len", "9-3"], "MIN <= MAX"),
        (["--prompt-len", "5-2000"], "at most 1000"),
        (["--mode", "z"], "'z' is not one of"),
        (["--hidden", "1"], "No such option '--hidden'"),
        (["--only-here", "1"], "No such option '--only-here'"),
    ):
        result = runner.invoke(foo, args)
        assert result.exit_code == 2 and message in result.output, (args, result.output)


def test_help_shows_the_dataclass_defaults() -> None:
    text = CliRunner().invoke(foo, ["--help"]).output
    assert "[default: 20-400]" in text
    assert "[default: --x 1]" in text
    assert "--ignore-eos / --no-ignore-eos" in text
