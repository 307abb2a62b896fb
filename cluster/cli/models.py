"""`opgraph models list` and `opgraph models serve`: the local models this machine has, and one served.

Owns the two commands' options and output: the list (name, file, size, whether llama.cpp is there
to run it) and the served model's announcement (the ``OPENAI_BASE_URL`` to export and the
``openai/<name>`` to name). Finding and checking models belongs to
``opgraph.actors.providers.local``; the server to ``opgraph.cluster.model_server``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from ..command_line import ExitCode
from .spine import command_group, subcommand

__all__ = ["add_models_parser"]


def _list(arguments: argparse.Namespace) -> int:
    from opgraph.actors.providers.local import INSTALL_HINT, LocalModel, installed_models, llama_cpp_version

    llama = llama_cpp_version()
    print(f"llama-cpp-python: {llama or 'not installed (' + INSTALL_HINT + ')'}")
    usable = 0
    for entry in installed_models():
        if isinstance(entry, LocalModel):
            usable += 1
            print(f"local/{entry.name}\t{entry.size / 1e6:.0f} MB\t{entry.path}\t(from {entry.source})")
        else:
            print(f"-\t{entry.message}")
    if not usable or llama is None:
        print(f"to run local models: {INSTALL_HINT}", file=sys.stderr)
    return ExitCode.OK if usable and llama else ExitCode.FAILED


def _serve(arguments: argparse.Namespace) -> int:
    from opgraph.actors.models import ProviderConfigError
    from opgraph.actors.providers.local import INSTALL_HINT, llama_cpp_version, local_model

    try:
        model = local_model(arguments.model)  # missing or not GGUF: refused now, before the port is bound
    except ProviderConfigError as exc:
        print(f"opgraph models serve: {exc.message}", file=sys.stderr)
        return ExitCode.USAGE
    if llama_cpp_version() is None:
        print(f"opgraph models serve: llama-cpp-python is not installed: {INSTALL_HINT}", file=sys.stderr)
        return ExitCode.USAGE
    from ..model_server import serve

    def announce(base_url: str, seconds: float) -> None:
        print(f"serving local/{model.name} ({model.path}) with {arguments.parallel} slot(s), "
              f"ready in {seconds:.1f} s; Ctrl-C stops it", flush=True)
        print(f"export OPENAI_BASE_URL={base_url}", flush=True)
        print(f"# then name the model openai/{model.name}, e.g. opgraph demo --model openai/{model.name}",
              flush=True)

    try:
        return serve(model, host=arguments.host, port=arguments.port, slots=arguments.parallel,
                     threads=arguments.threads, announce=announce)
    except OSError as exc:  # the port is taken, say
        print(f"opgraph models serve: cannot listen on {arguments.host}:{arguments.port}: {exc}", file=sys.stderr)
        return ExitCode.FAILED


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


def add_models_parser(subcommands: Any) -> None:
    actions = command_group(subcommands, "models", "the local models (the `local` extra): list them, serve one")
    listing = subcommand(actions, "list", "list the local models installed, and whether llama.cpp can run them",
                         codes=(ExitCode.OK, ExitCode.FAILED),
                         notes="FAILED when no local model can run here (the `local` extra is not installed).")
    listing.set_defaults(handler=_list)
    serve = subcommand(
        actions, "serve", "serve a local model OpenAI-compatibly on the loopback until Ctrl-C or SIGTERM",
        codes=(ExitCode.OK, ExitCode.FAILED, ExitCode.USAGE),
        description="Serve a local model at /v1/chat/completions (streamed or not, with JSON-schema "
                    "response_format) and /v1/models, and print the OPENAI_BASE_URL to export: the "
                    "`openai/` provider then calls it over HTTP as it would vLLM or llama.cpp's server.")
    serve.add_argument("--model", default="smollm2", help="the local model's name, as in `local/NAME` (smollm2)")
    serve.add_argument("--host", default="127.0.0.1", help="interface to listen on (127.0.0.1)")
    serve.add_argument("--port", type=int, default=8080, help="port to listen on, 0 for any free one (8080)")
    serve.add_argument("--parallel", type=_positive, default=1, metavar="N",
                       help="requests answered at once, each by a model instance of its own (1)")
    serve.add_argument("--threads", type=_positive, default=None, metavar="N",
                       help="CPU threads of each instance (default: half the cores shared out among the instances)")
    serve.set_defaults(handler=_serve)
