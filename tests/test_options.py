"""The options schema (graph_rewriter/options.py) is the one description of every rewrite
option: rewrite()'s keywords and docstring, the CLI's flags, the checks and the docs all
follow it. Nothing here rewrites a graph."""

import dataclasses
import inspect
import os
import re

import pytest

import graph_rewriter as gr
from graph_rewriter import cli
from graph_rewriter import options as schema
from graph_rewriter.cost_model import CostModel
from graph_rewriter.options import Options

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
SPECS = schema.specs()
KEYWORDS = schema.keywords()


def _read(path):
    with open(os.path.join(ROOT, path), encoding="utf-8") as f:
        return f.read()


def _parser_flags(parser):
    return set(parser._option_string_actions)


# ----- one description: rewrite() and the CLI follow the schema ------------------------

@pytest.mark.parametrize("field, spec", SPECS, ids=[f.name for f, _ in SPECS])
def test_every_option_is_a_documented_keyword_and_a_flag(field, spec):
    keyword = schema.keyword_of(field, spec)
    params = inspect.signature(gr.rewrite).parameters
    assert params[keyword].kind is inspect.Parameter.KEYWORD_ONLY
    assert params[keyword].default == schema.default_of(field)
    doc = gr.rewrite.__doc__
    assert f"``{keyword}``" in doc
    assert " ".join(spec.help.split()[:6]) in " ".join(doc.split())
    assert spec.help.strip(), f"{field.name} has no help text"
    if spec.api_only:
        assert not spec.cli
        return
    assert spec.cli, f"{field.name} has no flag and is not marked api_only"
    rewrite_flags = _parser_flags(cli._rewrite_parser())
    plan_flags = _parser_flags(cli._plan_parser())
    for flag in spec.cli:
        assert flag.name in rewrite_flags
        assert (flag.name in plan_flags) == ("plan" in flag.commands)
        assert flag.name in doc


def test_the_parsers_have_no_option_flag_the_schema_does_not_know():
    known = {flag.name for _, spec in SPECS for flag in spec.cli}
    own = {"-h", "--help", "--version", "--cluster", "-v", "--verbose", "--plan"}   # not rewrite options
    assert _parser_flags(cli._rewrite_parser()) - own == known
    assert _parser_flags(cli._plan_parser()) - own == {
        flag.name for _, spec in SPECS for flag in spec.cli if "plan" in flag.commands}


def test_public_keywords_are_kept():
    # docs/api.md (the contract) names these; renaming one breaks users
    assert set(KEYWORDS) >= {
        "strategy", "devices_per_worker", "device_type", "task", "bytes_per_pack", "compression",
        "sparse_as_dense", "merge", "gradients", "timeout_seconds", "sync", "staleness",
        "ps_shard_bytes", "verify_each", "dump_after", "dump_dir", "log", "accumulation_steps",
        "cost_model", "materialize_replicas", "batch_split"}
    params = inspect.signature(gr.rewrite).parameters
    assert list(params)[:2] == ["graph_def", "cluster_spec"] and params["cluster_spec"].default is None
    assert params["strategy"].default == "allreduce" and params["devices_per_worker"].default == 1
    assert params["device_type"].default == "GPU" and params["task"].default is None


# ----- keywords and values rejected ---------------------------------------------------------

@pytest.mark.parametrize("wrong, right", [("verify", "verify_each"), ("stratgy", "strategy"),
                                          ("devices_per_workers", "devices_per_worker"),
                                          ("gradient", "gradients")])
def test_an_unknown_keyword_names_it_and_the_closest_valid_one(wrong, right):
    with pytest.raises(gr.GraphRewriteError) as e:
        gr.rewrite(b"", **{wrong: 1})
    text = str(e.value)
    assert f"'{wrong}'" in text and f"'{right}'" in text
    assert e.value.hint and text.endswith(e.value.hint)


def test_an_unknown_keyword_far_from_any_lists_them_all():
    with pytest.raises(gr.GraphRewriteError, match="'zzzzqqq'") as e:
        Options.from_keywords(zzzzqqq=1)
    assert all(k in e.value.hint for k in KEYWORDS)


BAD_CANDIDATES = ["bogus", -1, 2.5, 5, object(), {"loss:0": "max"}, ("ok", "no", "three")]


@pytest.mark.parametrize("field, spec", SPECS, ids=[f.name for f, _ in SPECS])
def test_every_option_rejects_a_bad_value_naming_the_option(field, spec):
    keyword = schema.keyword_of(field, spec)
    names = {keyword, keyword.replace("_", " "), field.name}
    rejected = 0
    for bad in BAD_CANDIDATES:
        try:
            Options.from_keywords(**{keyword: bad})
        except gr.GraphRewriteError as e:   # anything else (a TypeError) fails the test
            rejected += 1
            assert any(n in str(e) for n in names), f"{keyword}={bad!r}: {e}"
    assert rejected, f"{keyword} accepts every one of {BAD_CANDIDATES}"


def test_the_defaults_validate_and_match_rewrites_defaults():
    built = Options.from_keywords()
    assert built == dataclasses.replace(Options(), cost_model=CostModel())
    assert Options().validate() == Options()


@pytest.mark.parametrize("flags, names", [
    (["--devices-per-worker", "0"], ["--devices-per-worker", "0"]),
    (["--device-type", "TPU"], ["--device-type", "'TPU'"]),
    (["--merge", "loss:0"], ["--merge", "NAME=VALUE"]),
    (["--gradient", "w"], ["--gradient", "NAME=VALUE"]),
    (["--inter-bandwidth", "0"], ["--inter-bandwidth", "positive"]),
    (["--intra-latency", "-1"], ["--intra-latency", "positive"]),
    (["--cost-batch-size", "0"], ["--cost-batch-size", "at least 1"]),
    (["--merge", "loss:0=max"], ["merge", "'max'"]),
    (["--strategy", "bogus"], ["strategy", "'bogus'"]),
    (["--accumulation-steps", "0"], ["accumulation_steps", "got 0"]),
])
def test_a_bad_flag_value_is_rejected_naming_it(flags, names):
    args = cli._rewrite_parser().parse_args(["in.pb", "out.pb", *flags])
    with pytest.raises(gr.GraphRewriteError) as e:
        kwargs = cli._rewrite_kwargs(args)
        kwargs.pop("cluster_spec")
        Options.from_keywords(**kwargs)
    for name in names:
        assert name in str(e.value)


# ----- the CLI and the API build the same Options -----------------------------------------

EQUIVALENT = [
    ([], {}),
    (["--strategy", "ps", "--devices-per-worker", "4", "--device-type", "CPU"],
     dict(strategy="ps", devices_per_worker=4, device_type="CPU")),
    (["--task", "worker:1"], dict(task="worker:1")),
    (["--compression", "none"], dict(compression=None)),
    (["--compression", "bf16", "--bytes-per-pack", "0", "--sparse-as-dense"],
     dict(compression="bf16", bytes_per_pack=0, sparse_as_dense=True)),
    (["--merge", "loss:0=sum", "--merge", "acc:0=mean"], dict(merge={"loss:0": "sum", "acc:0": "mean"})),
    (["--gradient", "w=g:0", "--gradient", "emb=v:0,i:0"],
     dict(gradients={"w": "g:0", "emb": ("v:0", "i:0")})),
    (["--strategy", "hybrid", "--async", "--ps-shard-bytes", "0", "--timeout-seconds", "0"],
     dict(strategy="hybrid", sync=False, ps_shard_bytes=0, timeout_seconds=0.0)),
    (["--strategy", "ps", "--staleness", "2", "--accumulation-steps", "3", "--batch-split", "per_replica"],
     dict(strategy="ps", staleness=2, accumulation_steps=3, batch_split="per_replica")),
    (["--strategy", "auto", "--inter-bandwidth", "3.1", "--intra-latency", "0", "--cost-batch-size", "64"],
     dict(strategy="auto", cost_model=CostModel(inter_bandwidth=3.1 * 1e9, intra_latency=0.0, batch_size=64))),
    (["--no-verify", "--dump-after", "replicate", "--dump-after", "plan", "--dump-dir", "/tmp/d",
      "--materialize-replicas"],
     dict(verify_each=False, dump_after=["replicate", "plan"], dump_dir="/tmp/d", materialize_replicas=True)),
]


@pytest.mark.parametrize("flags, keywords", EQUIVALENT, ids=[" ".join(f) or "defaults" for f, _ in EQUIVALENT])
def test_the_cli_and_the_api_build_the_same_options(flags, keywords):
    args = cli._rewrite_parser().parse_args(["in.pb", "out.pb", *flags])
    kwargs = cli._rewrite_kwargs(args, "rewrite")
    assert kwargs.pop("cluster_spec") is None
    assert Options.from_keywords(**kwargs) == Options.from_keywords(**keywords)
    rewrite_only = {flag.name for _, spec in SPECS for flag in spec.cli if "plan" not in flag.commands}
    if not set(flags) & rewrite_only:   # `graph-rewrite plan` takes the same flags the same way
        args = cli._plan_parser().parse_args(["in.pb", *flags])
        kwargs = cli._rewrite_kwargs(args, "plan")
        kwargs.pop("cluster_spec")
        assert Options.from_keywords(**kwargs) == Options.from_keywords(**keywords)


def test_without_flags_every_option_keeps_rewrites_default():
    args = cli._rewrite_parser().parse_args(["in.pb", "out.pb"])
    assert cli._rewrite_kwargs(args) == {"cluster_spec": None}


# ----- the docs list the schema -----------------------------------------------------------

def _api_md_rows():
    rows = {}
    for line in _read("docs/api.md").splitlines():
        m = re.match(r"\|\s*((?:`\w+`(?:,\s*)?)+)\s*\|\s*([^|]*?)\s*\|", line)
        if m and "keyword" not in line:
            names = re.findall(r"`(\w+)`", m.group(1))
            defaults = [d.strip() for d in m.group(2).split(",")] if len(names) > 1 else [m.group(2)]
            rows.update(zip(names, defaults))
    return rows


def _doc_default(field, spec):
    if spec.default_text:
        return spec.default_text
    value = schema.default_of(field)
    return f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`" if value in ({}, ()) else str(value)


def test_docs_api_md_lists_every_keyword_with_its_default():
    rows = _api_md_rows()
    assert set(rows) == set(KEYWORDS), "docs/api.md's keyword table and the schema differ"
    for field, spec in SPECS:
        documented = rows[schema.keyword_of(field, spec)]
        expected = _doc_default(field, spec)
        assert documented.split()[0] == expected.split()[0], (field.name, documented, expected)


def test_docs_cli_md_lists_every_flag():
    text = _read("docs/cli.md")
    for field, spec in SPECS:
        for flag in spec.cli:
            assert f"`{flag.name}" in text, f"docs/cli.md does not list {flag.name}"
