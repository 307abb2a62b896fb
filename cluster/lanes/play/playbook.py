"""Playbooks: ``NAME.playbook.yaml`` found, read, checked and rendered into a planned run's prompt.

Owns the playbook format (name, description, prompt template, typed args with defaults and
help, model, max_ops, reactive, workers, roles, max_assignments, synthesis; nothing else),
resolution (the working directory's ``.opgraph/playbooks/`` and each parent's up to the
project root, the user's config folder, then the bundled examples), the refusals (an unknown
name with suggestions, unknown fields, bad arg types, a symlink escaping its playbooks root)
and rendering the prompt with the positional input and the args. It plans and runs nothing.
"""

from __future__ import annotations

import difflib
import hashlib
import string
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from opgraph.actors.settings import opgraph_home
from opgraph.kernel import OpGraphError

__all__ = ["ARG_TYPES", "EXAMPLES_DIR", "PLAYBOOK_FIELDS", "PROJECT_MARKERS", "SUFFIX", "Playbook", "PlaybookArg",
           "PlaybookError", "UnknownPlaybookError", "list_playbooks", "load_playbook", "playbook_roots",
           "project_root", "resolve_playbook"]

SUFFIX = ".playbook.yaml"
PROJECT_MARKERS = ("pyproject.toml", ".git")  # what marks a project's root folder
EXAMPLES_DIR = Path(__file__).parent / "examples"
PLAYBOOK_FIELDS = frozenset({"name", "description", "prompt", "args", "model", "max_ops", "reactive", "workers",
                             "roles", "max_assignments", "synthesis"})
ARG_TYPES: dict[str, type] = {"str": str, "int": int, "float": float, "bool": bool}


class PlaybookError(OpGraphError):
    """A playbook is bad or cannot be used (unreadable, unknown fields, a bad arg or type, a symlink
    escaping its playbooks root); ``path`` says which file. Nothing was planned."""

    def __init__(self, message: str, *, path: str | None = None) -> None:
        super().__init__(message)
        self.path = path


class UnknownPlaybookError(PlaybookError):
    """No playbook by that name in any playbooks root; ``suggestions`` lists near names, ``searched`` the roots."""

    def __init__(self, name: str, suggestions: list[str], searched: list[str]) -> None:
        hint = f"; did you mean {', '.join(suggestions)}?" if suggestions else ""
        super().__init__(f"no playbook {name!r}{hint} (searched {', '.join(searched) or 'nothing'}; "
                         "`opgraph play list` lists them)")
        self.name, self.suggestions, self.searched = name, suggestions, searched


@dataclass(frozen=True)
class PlaybookArg:
    name: str
    type: str = "str"
    default: Any = None
    help: str = ""

    @property
    def required(self) -> bool:
        return self.default is None and self.type != "bool"

    def convert(self, value: Any) -> Any:
        """``value`` as this arg's type (text from a command line is parsed); a ``PlaybookError`` if it is not one."""
        kind = ARG_TYPES[self.type]
        if isinstance(value, kind) and not (kind is int and isinstance(value, bool)):
            return value
        text = str(value).strip()
        try:
            if kind is bool:
                lowered = text.lower()
                if lowered in ("1", "true", "yes", "on"):
                    return True
                if lowered in ("0", "false", "no", "off"):
                    return False
                raise ValueError(text)
            return kind(text)
        except ValueError:
            raise PlaybookError(f"arg {self.name!r} must be {self.type}, got {value!r}") from None


@dataclass(frozen=True)
class Playbook:
    name: str
    path: Path
    content_hash: str
    prompt: str
    description: str = ""
    args: tuple[PlaybookArg, ...] = ()
    settings: Mapping[str, Any] = field(default_factory=dict)  # model, max_ops, reactive, workers, roles, ...

    def placeholders(self) -> set[str]:
        return {name for _, name, _, _ in string.Formatter().parse(self.prompt) if name}

    def render(self, text: str, values: Mapping[str, Any]) -> str:
        """The prompt with ``{input}`` and each ``{arg}``; with no placeholder the positional text is appended."""
        filled = {arg.name: values.get(arg.name, arg.default) for arg in self.args}
        missing = [arg.name for arg in self.args if filled[arg.name] is None and arg.required]
        if missing:
            raise PlaybookError(f"playbook {self.name!r} needs {', '.join('--' + name for name in missing)}",
                                path=str(self.path))
        if not self.placeholders():
            return f"{self.prompt.rstrip()}\n\n{text}".strip() if text else self.prompt
        return self.prompt.format_map({**filled, "input": text})

    def convert(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """``values`` by arg name, each as its type; an unknown arg name is refused."""
        by_name = {arg.name: arg for arg in self.args}
        unknown = sorted(set(values) - set(by_name))
        if unknown:
            raise PlaybookError(f"playbook {self.name!r} takes no arg {', '.join(unknown)}; its args: "
                                f"{', '.join(by_name) or 'none'}", path=str(self.path))
        return {key: by_name[key].convert(value) for key, value in values.items()}


def project_root(start: str | Path | None = None) -> Path | None:
    """The nearest folder at or above ``start`` (default: the working directory) holding ``pyproject.toml``
    or ``.git``; None when no ancestor does."""
    start = Path(start or Path.cwd()).expanduser().resolve()
    return next((directory for directory in (start, *start.parents)
                 if any((directory / marker).exists() for marker in PROJECT_MARKERS)), None)


def playbook_roots(start: str | Path | None = None, home: str | Path | None = None) -> list[Path]:
    """Where playbooks are looked for, in order: ``.opgraph/playbooks`` of ``start`` and of each folder
    above it up to its project root (``project_root``; ``start`` alone when it is in no project), the
    user's config folder (``$OPGRAPH_HOME/playbooks``, or ``HOME/.opgraph/playbooks`` for a given
    ``home``), then the bundled examples.

    The climb stops at the project root: a folder above it (a shared parent, ``/tmp``) is not this
    project's and may be anyone's, so a playbook planted there is never picked up."""
    start = Path(start or Path.cwd()).expanduser().resolve()
    top = project_root(start) or start
    folders = [start, *start.parents]
    roots = [directory / ".opgraph" / "playbooks" for directory in folders[: folders.index(top) + 1]]
    config = (Path(home).expanduser().resolve() / ".opgraph" if home is not None else opgraph_home().resolve())
    if config / "playbooks" not in roots:
        roots.append(config / "playbooks")
    roots.append(EXAMPLES_DIR)
    return roots


def _inside(path: Path, root: Path) -> Path:
    """``path`` resolved; a ``PlaybookError`` when it resolves outside ``root`` (a symlink escaping it)."""
    resolved, root_resolved = path.resolve(), root.resolve()
    if not resolved.is_relative_to(root_resolved):
        raise PlaybookError(f"playbook {str(path)!r} is a link to {str(resolved)!r}, outside its playbooks root "
                            f"{str(root_resolved)!r}: refused", path=str(path))
    return resolved


def _names(roots: Iterable[Path]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for root in roots:
        if root.is_dir():
            for entry in sorted(root.glob(f"*{SUFFIX}")):
                found.setdefault(entry.name[: -len(SUFFIX)], entry)
    return found


def resolve_playbook(name: str, *, start: str | Path | None = None, home: str | Path | None = None) -> Playbook:
    """The first ``NAME.playbook.yaml`` in ``playbook_roots``, loaded and checked; ``UnknownPlaybookError`` else."""
    if not name or "/" in name or "\\" in name or name.startswith("."):
        raise PlaybookError(f"a playbook name is a plain name, got {name!r}")
    roots = playbook_roots(start, home)
    for root in roots:
        candidate = root / f"{name}{SUFFIX}"
        if candidate.exists() or candidate.is_symlink():
            return load_playbook(candidate, root=root)
    suggestions = difflib.get_close_matches(name, list(_names(roots)), n=3, cutoff=0.5)
    raise UnknownPlaybookError(name, suggestions, [str(root) for root in roots if root.is_dir()])


def list_playbooks(*, start: str | Path | None = None,
                   home: str | Path | None = None) -> list[Playbook | PlaybookError]:
    """Every playbook the roots hold (a nearer one hides a farther one of the same name); a bad one as its error."""
    found: list[Playbook | PlaybookError] = []
    roots = playbook_roots(start, home)
    seen: set[str] = set()
    for root in roots:
        if not root.is_dir():
            continue
        for entry in sorted(root.glob(f"*{SUFFIX}")):
            name = entry.name[: -len(SUFFIX)]
            if name in seen:
                continue
            seen.add(name)
            try:
                found.append(load_playbook(entry, root=root))
            except PlaybookError as exc:
                found.append(exc)
    return found


def load_playbook(path: str | Path, *, root: str | Path | None = None) -> Playbook:
    """Read and check one playbook file (YAML or JSON); every problem is a ``PlaybookError``."""
    import yaml

    path = Path(path)
    resolved = _inside(path, Path(root)) if root is not None else path.resolve()
    try:
        raw = resolved.read_bytes()
    except OSError as exc:
        raise PlaybookError(f"cannot read playbook {str(path)!r}: {exc.strerror or exc}", path=str(path)) from None
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise PlaybookError(f"playbook {str(path)!r} is not YAML or JSON: {exc}", path=str(path)) from None
    if not isinstance(data, dict):
        raise PlaybookError(f"playbook {str(path)!r} must be a mapping of fields", path=str(path))
    unknown = sorted(set(data) - PLAYBOOK_FIELDS)
    if unknown:
        raise PlaybookError(f"playbook {str(path)!r} has unknown fields: {', '.join(unknown)} (known: "
                            f"{', '.join(sorted(PLAYBOOK_FIELDS))})", path=str(path))
    name = path.name[: -len(SUFFIX)] if path.name.endswith(SUFFIX) else path.stem
    if data.get("name") not in (None, name):
        raise PlaybookError(f"playbook {str(path)!r} names itself {data['name']!r}, not {name!r}", path=str(path))
    prompt = data.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise PlaybookError(f"playbook {str(path)!r} needs a prompt (a template with {{input}} and {{arg}} "
                            "placeholders)", path=str(path))
    args = tuple(_arg(path, arg_name, spec) for arg_name, spec in (_mapping(path, "args", data.get("args"))).items())
    _check_settings(path, data)
    playbook = Playbook(name=name, path=resolved, content_hash="sha256:" + hashlib.sha256(raw).hexdigest(),
                        prompt=prompt, description=str(data.get("description") or ""), args=args,
                        settings={key: data[key] for key in ("model", "max_ops", "reactive", "workers", "roles",
                                                             "max_assignments", "synthesis") if key in data})
    unknown_placeholders = playbook.placeholders() - {"input"} - {arg.name for arg in args}
    if unknown_placeholders:
        raise PlaybookError(f"playbook {str(path)!r}'s prompt uses {', '.join(sorted(unknown_placeholders))}, "
                            "which are not args", path=str(path))
    return playbook


def _mapping(path: Path, key: str, value: Any) -> dict[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise PlaybookError(f"playbook {str(path)!r}: {key} must be a mapping", path=str(path))
    return value


def _arg(path: Path, name: Any, spec: Any) -> PlaybookArg:
    if not isinstance(name, str) or not name.isidentifier() or name == "input":
        raise PlaybookError(f"playbook {str(path)!r}: arg name {name!r} must be an identifier other than 'input'",
                            path=str(path))
    spec = {"type": spec} if isinstance(spec, str) else spec
    if not isinstance(spec, dict) or set(spec) - {"type", "default", "help"}:
        raise PlaybookError(f"playbook {str(path)!r}: arg {name!r} takes type, default and help only",
                            path=str(path))
    kind = spec.get("type", "str")
    if kind not in ARG_TYPES:
        raise PlaybookError(f"playbook {str(path)!r}: arg {name!r} has type {kind!r}; types: "
                            f"{', '.join(ARG_TYPES)}", path=str(path))
    arg = PlaybookArg(name, kind, None, str(spec.get("help") or ""))
    if spec.get("default") is not None:
        arg = PlaybookArg(name, kind, arg.convert(spec["default"]), arg.help)
    return arg


def _check_settings(path: Path, data: Mapping[str, Any]) -> None:
    def bad(key: str, what: str) -> PlaybookError:
        return PlaybookError(f"playbook {str(path)!r}: {key} must be {what}, got {data[key]!r}", path=str(path))

    for key in ("max_ops", "workers", "max_assignments"):
        if key in data and (isinstance(data[key], bool) or not isinstance(data[key], int) or data[key] < 0):
            raise bad(key, "a whole number >= 0")
    for key in ("model", "reactive", "description"):
        if key in data and not isinstance(data[key], str):
            raise bad(key, "text")
    if "synthesis" in data and not isinstance(data["synthesis"], bool):
        raise bad("synthesis", "true or false")
    if "roles" in data and (not isinstance(data["roles"], dict) or not data["roles"]
                            or not all(isinstance(k, str) and isinstance(v, str) for k, v in data["roles"].items())):
        raise bad("roles", "a mapping of role name to what it does")
