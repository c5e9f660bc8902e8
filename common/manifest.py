"""Weight manifests: what a model folder's bytes must be, so corruption is caught, not run.

``manifest.json`` beside a model's files records the size and sha256 of every file and, for
each safetensors file, the sha256 of its header and of every tensor's byte range in the data
section (the ranges tile the section exactly, padding included). A draft's ranges are what
the loader checks while it copies the section into a slot, so a flipped byte is named by its
tensor and never bound; the decoder checks the same at start, and the target's files once
per change of the file (see :func:`verify`).

Written by ``memspec zoo target``, by the draft training (:func:`write_manifest`) and, for a
folder a user brings, by ``memspec manifest DIR``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memspec.common.errors import ModelError
from memspec.common.files import sha256_file
from memspec.common.messages import TensorRange as Range
from memspec.common.safetensors_layout import Layout, read_layout

FORMAT = "memspec-manifest/1"
NAME = "manifest.json"
CHUNK = 1 << 20
PADDING = "(padding)"  # a range of data-section bytes no tensor claims
DOCS = (".md",)  # listed, checked by `memspec manifest --check`, not before a draft runs


def _fix(folder: Path) -> str:
    return f"re-copy the files, or if they are right: memspec manifest {folder}"


@dataclass(frozen=True)
class WeightsEntry:
    """One safetensors file: its header and the ranges that tile its data section."""

    file: str
    data_offset: int
    data_size: int
    header_sha256: str
    ranges: tuple[Range, ...]

    def check_layout(self, layout: Layout) -> None:
        """The file's header still describes the bytes the manifest was made of."""
        if (layout.data_offset, layout.data_size) != (self.data_offset, self.data_size):
            raise ModelError(
                f"{layout.path} has a {layout.data_offset - 8}-byte header and a "
                f"{layout.data_size}-byte data section, its manifest "
                f"{self.data_offset - 8} and {self.data_size}", _fix(layout.path.parent))
        with layout.path.open("rb") as f:
            header = f.read(layout.data_offset)
        if hashlib.sha256(header).hexdigest() != self.header_sha256:
            raise ModelError(f"{layout.path} header differs from its manifest",
                             _fix(layout.path.parent))


    def check_bytes(self, data: bytes | memoryview, where: str) -> None:
        """A copy of the data section in memory (a slot's first bytes) is this file's."""
        check = RangeVerifier(self.ranges, where)
        check.update(0, memoryview(data)[:self.data_size])
        if not check.complete:
            raise ModelError(f"{where}: holds {len(data)} of {self.data_size} bytes",
                             "re-copy the weight file")


@dataclass(frozen=True)
class Manifest:
    folder: Path
    files: dict[str, tuple[int, str]]  # relative path -> (size, sha256)
    weights: dict[str, WeightsEntry]  # safetensors files, by relative path

    def entry(self, path: Path) -> WeightsEntry:
        rel = Path(path).resolve().relative_to(self.folder.resolve()).as_posix()
        if rel not in self.weights:
            raise ModelError(f"{self.folder / NAME} does not cover {rel}", _fix(self.folder))
        return self.weights[rel]


class RangeVerifier:
    """Streams a data section and checks every range as soon as its last byte has passed,
    so a corrupt tensor fails the copy at that tensor, named."""

    def __init__(self, ranges: tuple[Range, ...] | list[Range], where: str) -> None:
        self.ranges = list(ranges)
        self.where = where
        self._i = 0
        self._h = hashlib.sha256()

    def update(self, pos: int, data: bytes | memoryview) -> None:
        """Feed the bytes at section offset ``pos`` (calls must be contiguous and in order)."""
        view = memoryview(data)
        end = pos + len(view)
        while pos < end and self._i < len(self.ranges):
            r = self.ranges[self._i]
            take = min(end, r.end) - pos
            self._h.update(view[:take])
            view = view[take:]
            pos += take
            if pos == r.end:
                if self._h.hexdigest() != r.sha256:
                    raise ModelError(f"{self.where}: tensor '{r.name}' (bytes {r.start}-{r.end}) "
                                     "differs from its manifest", "re-copy the weight file")
                self._i += 1
                self._h = hashlib.sha256()

    @property
    def complete(self) -> bool:
        return self._i == len(self.ranges)


def tile(layout: Layout) -> list[tuple[str, int, int]]:
    """The layout's tensors as ranges that cover its data section exactly (gaps named)."""
    out, pos = [], 0
    for t in layout.tensors:
        if t.start > pos:
            out.append((PADDING, pos, t.start))
        if t.end > t.start:
            out.append((t.name, t.start, t.end))
        pos = max(pos, t.end)
    if pos < layout.data_size:
        out.append((PADDING, pos, layout.data_size))
    return out


def _section(path: Path, offset: int, size: int) -> Iterator[bytes]:
    with path.open("rb") as f:
        f.seek(offset)
        left = size
        while left > 0:
            chunk = f.read(min(CHUNK, left))
            if not chunk:
                raise ModelError(f"{path} is truncated", "re-copy the weight file")
            left -= len(chunk)
            yield chunk


def weights_entry(path: Path, rel: str) -> WeightsEntry:
    """Measure one safetensors file (its header must parse)."""
    layout = read_layout(path)
    spans = tile(layout)
    hashes = [hashlib.sha256() for _ in spans]
    i, pos = 0, 0
    for chunk in _section(path, layout.data_offset, layout.data_size):
        view = memoryview(chunk)
        while view:
            name, start, end = spans[i]
            take = min(len(view), end - pos)
            hashes[i].update(view[:take])
            view, pos = view[take:], pos + take
            if pos == end:
                i += 1
    with path.open("rb") as f:
        header = hashlib.sha256(f.read(layout.data_offset)).hexdigest()
    ranges = tuple(Range(n, s, e, h.hexdigest()) for (n, s, e), h in zip(spans, hashes))
    return WeightsEntry(rel, layout.data_offset, layout.data_size, header, ranges)


def _listed(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != NAME
                  and not any(part.startswith(".") for part in p.relative_to(folder).parts))


def build_manifest(folder: Path) -> dict[str, Any]:
    folder = Path(folder)
    files, weights = {}, {}
    for p in _listed(folder):
        rel = p.relative_to(folder).as_posix()
        files[rel] = {"size": p.stat().st_size, "sha256": sha256_file(p)}
        if p.suffix == ".safetensors":
            e = weights_entry(p, rel)
            weights[rel] = {"data_offset": e.data_offset, "data_size": e.data_size,
                            "header_sha256": e.header_sha256,
                            "tensors": [[r.name, r.start, r.end, r.sha256] for r in e.ranges]}
    if not weights:
        raise ModelError(f"{folder} holds no .safetensors file", "point at a model folder")
    return {"format": FORMAT, "files": files, "weights": weights}


def write_manifest(folder: Path) -> Path:
    """Measure ``folder`` and write its manifest (atomically); returns the manifest path.
    Call it last, once every file of the model is final."""
    folder = Path(folder)
    doc = build_manifest(folder)
    out = folder / NAME
    tmp = out.with_name(f".{NAME}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(out)
    return out


def _bad(folder: Path, why: str) -> ModelError:
    return ModelError(f"{folder / NAME} is not a valid manifest ({why})",
                      f"rewrite it: memspec manifest {folder}")


def read_manifest(folder: Path) -> Manifest | None:
    """The folder's manifest, None when it has none; a malformed one is a ModelError."""
    folder = Path(folder)
    path = folder / NAME
    if not path.is_file():
        return None
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise _bad(folder, type(exc).__name__) from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        raise _bad(folder, f"format is not {FORMAT}")
    try:
        files = {str(k): (int(v["size"]), str(v["sha256"])) for k, v in doc["files"].items()}
        weights = {}
        for rel, w in doc["weights"].items():
            ranges = tuple(Range(str(n), int(s), int(e), str(h)) for n, s, e, h in w["tensors"])
            weights[rel] = WeightsEntry(rel, int(w["data_offset"]), int(w["data_size"]),
                                        str(w["header_sha256"]), ranges)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise _bad(folder, f"{type(exc).__name__}: {exc}") from None
    for w in weights.values():
        pos = 0
        for r in w.ranges:
            if r.start != pos or r.end <= r.start:
                raise _bad(folder, f"the ranges of {w.file} do not tile its data section")
            pos = r.end
        if pos != w.data_size:
            raise _bad(folder, f"the ranges of {w.file} do not cover its data section")
    return Manifest(folder, files, weights)


def verify_section(path: Path, entry: WeightsEntry) -> None:
    """Read the file's data section and check every range (a full read of the section)."""
    layout = read_layout(path)
    entry.check_layout(layout)
    check = RangeVerifier(entry.ranges, str(path))
    pos = 0
    for chunk in _section(path, layout.data_offset, layout.data_size):
        check.update(pos, chunk)
        pos += len(chunk)


def verify(manifest: Manifest, stamps: Path | None = None, docs: bool = False) -> None:
    """Every file the manifest lists has its size and bytes: a safetensors file header and
    tensor by tensor (a mismatch names the tensor), any other file by its sha256. Model
    cards (``*.md``) are skipped unless ``docs``: editing one must not quarantine a draft.
    With ``stamps`` (a JSON file), a file whose (size, mtime, inode) matches its last good
    check is not read again: the large target is hashed once per change, not every start."""
    seen = _read_stamps(stamps)
    fresh = {}
    for rel, (size, digest) in manifest.files.items():
        if not docs and rel.endswith(DOCS):
            continue
        p = manifest.folder / rel
        try:
            st = p.stat()
        except OSError:
            raise ModelError(f"{p} is missing", _fix(manifest.folder)) from None
        if st.st_size != size:
            raise ModelError(f"{p} has {st.st_size} bytes, its manifest {size}",
                             _fix(manifest.folder))
        key = str(p.resolve())
        stamp = [st.st_size, st.st_mtime_ns, st.st_ino, digest]
        if seen.get(key) != stamp:
            if rel in manifest.weights:
                verify_section(p, manifest.weights[rel])
            elif sha256_file(p) != digest:
                raise ModelError(f"{p} differs from its manifest (sha256)", _fix(manifest.folder))
        fresh[key] = stamp
    if stamps is not None and fresh:
        _write_stamps(stamps, {**seen, **fresh})


def _read_stamps(path: Path | None) -> dict[str, list]:
    if path is None or not path.is_file():
        return {}
    try:
        doc = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return doc if isinstance(doc, dict) else {}


def _write_stamps(path: Path, stamps: dict[str, list]) -> None:
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
        tmp.write_text(json.dumps(stamps))
        tmp.replace(path)
    except OSError:
        pass  # a read-only home only costs a re-hash next time


def check_folder(folder: Path) -> list[str]:
    """Every problem with a folder against its manifest, as one line each (empty: good)."""
    try:
        man = read_manifest(folder)
        if man is None:
            return [f"{Path(folder) / NAME} not found (write one: memspec manifest {folder})"]
        verify(man, docs=True)
    except ModelError as exc:
        return [str(exc)]
    return []
