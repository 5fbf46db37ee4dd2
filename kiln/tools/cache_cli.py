"""`kiln cache ls | verify | clear | diff | export | import`: look after the compile cache
(KILN_CACHE_ROOT).

    kiln cache ls                 every entry: model, device, size, age, complete or not (+aot: with AOT
                                  packages of every piece), shapes
    kiln cache verify [KEY ...]   every file against its checksum in the manifest
    kiln cache clear KEY ... | --all
    kiln cache diff A B           why two keys differ, factor by factor
    kiln cache export [KEY ...] -o FILE   entries, the Triton kernel cache and the tuning, in one file
    kiln cache import FILE        checked whole, then unpacked into this cache root

A KEY may be shortened to any unique prefix.
"""

from __future__ import annotations

import datetime
import json
from pathlib import Path

from kiln.compile.cache import CacheEntry, CacheRoot
from kiln.compile.cache.key import FACTORS


def ls(root: CacheRoot) -> list[str]:
    entries = root.entries()
    if not entries:
        return [f"no cache entries in {root.path}"]
    lines = [f"{root.path}:", f"{'KEY':16}  {'MODEL':14} {'DEVICE':8} {'DTYPE':9} {'SIZE':>9} {'AGE':>6}  "
             f"{'STATE':13} SHAPES"]
    for entry in entries:
        try:
            manifest = entry.read_manifest() or {}
        except ValueError:
            lines.append(f"{entry.key:16}  unreadable manifest (the next start rebuilds it)")
            continue
        entry.manifest = manifest
        cover = entry.coverage()
        shapes = [f"[{lo},{hi}]" for lo, hi in cover["ranges"]] + [str(n) for n in cover["sizes"]]
        state = ("complete+aot" if entry.packaged() else "complete") if entry.complete() else \
            "partial" if manifest else "empty"
        lines.append(f"{entry.key:16}  {manifest.get('model', '?')[:14]:14} {manifest.get('device', '?'):8} "
                     f"{manifest.get('dtype', '?'):9} {_size(entry.size_bytes()):>9} "
                     f"{_age(manifest.get('updated')):>6}  {state:13} {' '.join(shapes) or '-'}")
    return lines


def verify(root: CacheRoot, keys: list[str]) -> tuple[bool, list[str]]:
    entries = [root.find(k) for k in keys] if keys else root.entries()
    ok, lines = True, []
    for entry in entries:
        with entry.lock():
            try:
                entry.manifest = entry.read_manifest() or {}
            except ValueError as e:
                ok = False
                lines.append(f"{entry.key}: BAD {e}")
                continue
            bad = entry.bad_files()
        files = len(entry.manifest.get("files", {}))
        ok = ok and not bad
        lines.append(f"{entry.key}: {'OK' if not bad else 'BAD'} ({files} files checked)")
        lines += [f"  fails its checksum: {entry.path / rel}" for rel in bad]
    if not entries:
        lines.append(f"no cache entries in {root.path}")
    return ok, lines


def clear(root: CacheRoot, keys: list[str], everything: bool) -> list[str]:
    if everything == bool(keys):
        raise ValueError("kiln cache clear takes entry keys or --all, not both and not neither")
    entries = root.entries() if everything else [root.find(k) for k in keys]
    for entry in entries:
        entry.clear()
    if everything and (root.path / "index").exists():
        for index in (root.path / "index").iterdir():
            index.unlink()
    return [f"removed {entry.key}" for entry in entries] or [f"no cache entries in {root.path}"]


def diff(root: CacheRoot, a: str, b: str) -> list[str]:
    first, second = root.find(a), root.find(b)
    lines = [f"{first.key} -> {second.key}"]
    for factor in FACTORS:
        left, right = _flat(_factor(first, factor)), _flat(_factor(second, factor))
        changes = [f"    {k}: {_show(left.get(k, _MISSING))} -> {_show(right.get(k, _MISSING))}"
                   for k in sorted(set(left) | set(right)) if left.get(k, _MISSING) != right.get(k, _MISSING)]
        lines.append(f"  {factor}: {'same' if not changes else f'{len(changes)} difference(s)'}")
        lines += changes
    return lines


_MISSING = object()


def _factor(entry: CacheEntry, name: str) -> dict:
    try:
        return json.loads((entry.path / f"{name}.json").read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{entry.path / (name + '.json')} is unreadable: {e}") from None


def _flat(value, prefix: str = "") -> dict:
    if isinstance(value, dict) and value:
        out = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}.{k}" if prefix else str(k)))
        return out
    return {prefix or "(value)": value}


def _show(value) -> str:
    return "(absent)" if value is _MISSING else json.dumps(value)


def describe_archive(path, manifest: dict, verb: str) -> str:
    files = manifest["files"]
    kernels = sum(1 for name in files if name.startswith("triton/"))
    entries = ", ".join(f"{key} ({model})" for key, model in manifest.get("models", {}).items()) or "no entries"
    return (f"{verb} {path}: {entries}; {kernels} Triton kernel-cache files; {len(files)} files, "
            f"{_size(sum(f['bytes'] for f in files.values()))}; made with kiln {manifest['kiln']}, torch "
            f"{manifest['torch']}, triton {manifest['triton']}, GPU {manifest['gpu'] or 'none'}")


def _size(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _age(stamp: str | None) -> str:
    if not stamp:
        return "?"
    seconds = (datetime.datetime.now(datetime.timezone.utc) - datetime.datetime.fromisoformat(stamp)).total_seconds()
    for unit, span in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= span:
            return f"{seconds / span:.0f}{unit}"
    return f"{seconds:.0f}s"


def register(commands) -> None:
    cache = commands.add_parser("cache", help="list, verify, clear or compare compile-cache entries (KILN_CACHE_ROOT)")
    sub = cache.add_subparsers(dest="cache_command", required=True)
    sub.add_parser("ls", help="every entry: model, device, size, age, complete or not, shapes")
    check = sub.add_parser("verify", help="check every file of the entries against its checksum")
    check.add_argument("keys", nargs="*", help="entry keys or unique prefixes (default: all)")
    drop = sub.add_parser("clear", help="remove entries")
    drop.add_argument("keys", nargs="*", help="entry keys or unique prefixes")
    drop.add_argument("--all", action="store_true", help="remove every entry")
    compare = sub.add_parser("diff", help="why two entries' keys differ, factor by factor")
    compare.add_argument("a")
    compare.add_argument("b")
    out = sub.add_parser("export", help="entries, Triton's kernel cache and the GEMV tuning of this root in one file")
    out.add_argument("keys", nargs="*", help="entry keys or unique prefixes (none: only kernels and tuning)")
    out.add_argument("-o", "--output", required=True, help="the archive to write (a tar)")
    into = sub.add_parser("import", help="check an archive whole, then unpack it into this cache root")
    into.add_argument("file")
    cache.set_defaults(func=run)


def run(args) -> int:
    root = CacheRoot()
    if args.cache_command == "ls":
        print("\n".join(ls(root)))
        return 0
    if args.cache_command == "verify":
        ok, lines = verify(root, args.keys)
        print("\n".join(lines))
        return 0 if ok else 1
    if args.cache_command == "clear":
        print("\n".join(clear(root, args.keys, args.all)))
        return 0
    if args.cache_command == "export":
        from kiln.compile.cache.archive import export

        print(describe_archive(args.output, export(root, args.keys, Path(args.output)), "wrote"))
        return 0
    if args.cache_command == "import":
        from kiln.compile.cache import source_keys
        from kiln.compile.cache.archive import import_archive

        print(describe_archive(args.file, import_archive(root, Path(args.file)), f"imported into {root.path} from"))
        source_keys.record(root.path)  # so that a start here hashes neither torch's sources nor Triton's
        return 0
    print("\n".join(diff(root, args.a, args.b)))
    return 0
