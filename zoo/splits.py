"""Which origins (documents, templates, families) feed train, dev, dev2 and test2 prompts.

The corpora (:mod:`memspec.zoo.corpora`) put every group wholly in the drafts' training
text or held out. A prompt's *source* is finer or coarser than a group depending on the
domain, so the split here works on source keys, several per document where an origin is
shared in more than one way:

- general: the document (a State of the Union speech, a Moby-Dick chapter, a Python
  documentation page);
- code: the HumanEval task; a stdlib module file and its top-level package;
- math: the GSM-symbolic template (all instances of one template are one source), or the
  CHAMP problem;
- law: the licence group (a family, joined with every near-duplicate licence of another
  family) and the licence's own family, so that e.g. a ``gpl-*`` text merged into another
  group still ties its family to that group;
- medical: every is-a parent of an HPO term (siblings under any parent are one source),
  and the term's own children: a term is only used if no child of it is training text.

Training documents claim their keys for ``train``. Held-out documents are joined into
components through shared keys; a component with any key claimed by training text is
unused, the others go whole to ``dev`` (every third in seeded-hash order, per kind of
source so that both sets see the same mix) or ``dev2``. dev2 was the ``test`` split until
many bench runs had read it, so it is a second dev set now; its name changed, not its
sources (the seeded order does not depend on the name). Once every other set is built, the
components none of their prompts used move whole to ``test2`` (`DomainSplit.reserve`): a
test set read by nothing before it.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from memspec.zoo.corpora import Doc, licence_family, stable_hash

SPLITS = ("train", "dev", "dev2", "test2")
DEV_EVERY = 3  # rank % DEV_EVERY == 0 -> dev: a third of the held-out sources, the rest dev2


def source_keys(domain: str, doc: Doc) -> tuple[list[str], list[str]]:
    """(keys, near) of one document; ``keys[0]`` (its group) is the prompt rows' ``source``.

    ``near`` names sources that must not be training text and must sit in the same split
    (an HPO term's children).
    """
    group, doc_id, meta = doc["group"], doc["id"], doc.get("meta", {})
    if domain == "code" and doc_id.startswith("stdlib:"):
        top = doc_id.removeprefix("stdlib:").split("/", 1)[0].removesuffix(".py")
        return [group, f"stdlib-package:{top}"], []
    if domain == "law":
        return [group, f"licence-family:{licence_family(doc_id.removeprefix('licence:'))}"], []
    if domain == "medical":
        term = doc_id.removeprefix("hpo:")
        parents = meta.get("parents") or []
        return [group, *(f"hpo-family:{p}" for p in parents[1:])], [f"hpo-family:{term}"]
    return [group], []


class _UnionFind:
    def __init__(self) -> None:
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        self.parent.setdefault(x, x)
        while self.parent[x] != x:
            self.parent[x] = self.parent[self.parent[x]]
            x = self.parent[x]
        return x

    def union(self, keys: Sequence[str]) -> None:
        roots = sorted({self.find(k) for k in keys})
        for r in roots[1:]:
            self.parent[r] = roots[0]


@dataclass
class DomainSplit:
    """One domain's assignment: keys per split, and the usable held-out docs' splits."""

    domain: str
    keys: dict[str, set[str]] = field(default_factory=lambda: {s: set() for s in SPLITS})
    doc_split: dict[str, str] = field(default_factory=dict)  # usable held-out doc -> dev|dev2
    unused_docs: int = 0
    doc_root: dict[str, str] = field(default_factory=dict)  # usable held-out doc -> component
    members: dict[str, list[str]] = field(default_factory=dict)  # component -> its keys

    def split_of(self, source: str) -> str | None:
        return next((s for s in SPLITS if source in self.keys[s]), None)

    def manifest(self) -> dict[str, list[str]]:
        return {s: sorted(self.keys[s]) for s in SPLITS}

    def reserve(self, split: str, roots: set[str]) -> None:
        """Move whole components (their keys and usable docs) to `split`: a set built
        after the others, from held-out sources none of their prompts used."""
        for root in roots:
            keys = set(self.members.get(root, ()))
            for other in SPLITS:
                if other != split:
                    self.keys[other] -= keys
            self.keys[split] |= keys
        for doc_id, root in self.doc_root.items():
            if root in roots:
                self.doc_split[doc_id] = split


def assign_sources(domain: str, train: Sequence[Doc], heldout: Sequence[Doc]) -> DomainSplit:
    """Claim training keys, join held-out docs into components, send each whole to a split."""
    out = DomainSplit(domain)
    for doc in train:
        out.keys["train"].update(source_keys(domain, doc)[0])
    uf = _UnionFind()
    held = [(doc, *source_keys(domain, doc)) for doc in heldout]
    for _, keys, _ in held:
        uf.union(keys)
    members: dict[str, list[str]] = defaultdict(list)  # component root -> its keys
    for key in list(uf.parent):
        members[uf.find(key)].append(key)
    split_of: dict[str, str] = {}
    by_kind: dict[str, list[str]] = defaultdict(list)
    for root, keys in members.items():
        if not out.keys["train"].intersection(keys):
            by_kind[root.split(":", 1)[0]].append(root)
    for _, roots in sorted(by_kind.items()):
        ranked = sorted(roots, key=lambda r: (stable_hash("source-split", domain, r), r))
        for rank, root in enumerate(ranked):
            split = "dev" if rank % DEV_EVERY == 0 else "dev2"
            split_of[root] = split
            out.keys[split].update(members[root])
    for doc, keys, near in held:
        split = split_of.get(uf.find(keys[0]))
        near_ok = all(k not in out.keys["train"]
                      and (k not in uf.parent or split_of.get(uf.find(k)) == split)
                      for k in near)
        if split is not None and near_ok:
            out.doc_split[doc["id"]] = split
            root = uf.find(keys[0])
            out.doc_root[doc["id"]] = root
            out.members[root] = sorted(members[root])
        else:
            out.unused_docs += 1
    return out
