"""The documentation points where it says: every relative link of README.md and docs/*.md
reaches a file of the repository (and a heading, for a link with an anchor); the public
contract is docs/api.md, and nothing refers to a contract file outside the repository as
if it were in it; gr.Session documents its own arguments."""

import inspect
import os
import pydoc
import re

import pytest

import graph_rewriter as gr
from graph_rewriter.api import RewriteResult

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIPPED_DIRS = {".git", ".venv", "__pycache__", "build", "dist", ".pytest_cache", ".hypothesis", ".mypy_cache"}
FENCED = re.compile(r"^```.*?^```$", re.S | re.M)
LINK = re.compile(r"(?<!!)\[[^\]\n]*\]\(([^)\s]+)\)")


def _read(path):
    with open(os.path.join(REPO, path), encoding="utf-8") as f:
        return f.read()


def _markdown_files():
    docs = sorted(os.path.join("docs", n) for n in os.listdir(os.path.join(REPO, "docs")) if n.endswith(".md"))
    return ["README.md"] + docs


def _slug(heading):
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(path):
    anchors, seen = set(), {}
    for line in FENCED.sub("", _read(path)).splitlines():
        m = re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line)
        if m:
            slug = _slug(m.group(1))
            n = seen.get(slug, 0)
            seen[slug] = n + 1
            anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


@pytest.mark.parametrize("path", _markdown_files())
def test_every_relative_link_reaches_a_file_and_heading(path):
    broken = []
    for target in LINK.findall(FENCED.sub("", _read(path))):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):        # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        resolved = os.path.normpath(os.path.join(os.path.dirname(path), file_part)) if file_part else path
        if not os.path.exists(os.path.join(REPO, resolved)):
            broken.append(f"{target}: no file {resolved}")
        elif anchor and resolved.endswith(".md") and anchor not in _anchors(resolved):
            broken.append(f"{target}: {resolved} has no heading with anchor #{anchor}")
    assert not broken, f"{path}: broken links:\n" + "\n".join(broken)


def _repository_text_files():
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not d.endswith(".egg-info")
                         and not d.startswith("venv"))
        for name in sorted(files):
            path = os.path.join(root, name)
            if os.path.getsize(path) > 2_000_000:
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    yield os.path.relpath(path, REPO), f.read()
            except UnicodeDecodeError:
                continue


def test_nothing_refers_to_a_contract_file_outside_the_repository_as_if_it_were_in_it():
    # The team's shared contract file is not part of the repository: docs/api.md is its
    # copy here. A reference that says where the shared one is ("shared/...") is fine.
    bare = []
    for path, text in _repository_text_files():
        for m in re.finditer(r"API\.md", text):
            before = text[max(0, m.start() - 7):m.start()]
            if before.endswith(("shared/", "shared ")):
                continue
            line = text.count("\n", 0, m.start()) + 1
            bare.append(f"{path}:{line}: {text.splitlines()[line - 1].strip()}")
    assert not bare, "refer to docs/api.md instead:\n" + "\n".join(bare)


def test_docs_api_md_states_the_contract():
    text = _read("docs/api.md")
    headings = {line.lstrip("#").strip() for line in text.splitlines() if line.startswith("## ")}
    assert {"Python", "Semantics", "CLI", "Checkpoints and TF1 tools"} <= headings
    for phrase in ["gr.rewrite(", "cluster_spec=None", 'strategy="allreduce"', "devices_per_worker=1",
                   'device_type="GPU"', "task=None", "result.graph_def", "result.num_replicas", "result.plan",
                   "result.save(path)", "gr.load(path)", 'gr.Session(result, target="", config=None)',
                   "gr.start_server(cluster_spec, task)", "gr.GraphRewriteError", "TF_CONFIG",
                   "graph-rewrite IN OUT", "graph-rewrite inspect FILE", "graph-rewrite serve --cluster SPEC",
                   "graph-rewrite demo", "exit 2", "byte-identical OUT", "original variable names",
                   "result.saver()", "MonitoredTrainingSession", "is_chief=(i == 0)",
                   "graph_rewriter/broadcast_variables", "tutorial.md"]:
        assert phrase in text, f"docs/api.md does not say {phrase!r}"
    # the names it promises exist
    for name in ["rewrite", "load", "Session", "start_server", "GraphRewriteError"]:
        assert name in gr.__all__ and getattr(gr, name)
    for attribute in ["graph_def", "num_replicas", "plan", "save", "saver", "summary"]:
        assert hasattr(RewriteResult, attribute), attribute


def test_the_package_and_rewrite_send_readers_to_docs_api_md():
    assert "docs/api.md" in gr.__doc__
    assert "docs/api.md" in gr.rewrite.__doc__
    assert "[docs/api.md](docs/api.md)" in _read("README.md")


def test_session_documents_its_own_arguments():
    doc = gr.Session.__doc__
    assert 'Session(result, target="", config=None)' in doc
    for word in ["result:", "target:", "config:", "num_replicas", "docs/api.md", "GraphRewriteError"]:
        assert word in doc, word
    assert not re.search(r"^\s*graph\s*:", doc, re.M) and "graph=" not in doc
    params = inspect.signature(gr.Session).parameters
    assert list(params) == ["result", "target", "config"]
    assert params["target"].default == "" and params["config"].default is None


def _help(obj):
    return pydoc.render_doc(obj, renderer=pydoc.plaintext)


def test_help_of_session_leads_with_its_own_arguments():
    text = _help(gr.Session)
    own = text[:text.index("Method resolution order")]
    assert "Session(result, target='', config=None)" in own and "result:" in own
    assert not re.search(r"^\W*graph\s*:", own, re.M)


def test_help_of_session_shows_no_graph_argument():
    """Session.__init__ has its own docstring: help() would otherwise show
    tf.compat.v1.Session.__init__'s, with a `graph` argument that does not exist."""
    assert not re.search(r"^\W*graph\s*:", _help(gr.Session), re.M)
