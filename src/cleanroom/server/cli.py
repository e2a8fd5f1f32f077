"""``cleanroom serve`` and ``cleanroom keys create|list|revoke`` (registered by ``cli``)."""

from __future__ import annotations

import asyncio
import functools
import json
import sys
from collections.abc import Callable
from typing import Annotated

import typer
from rich.console import Console

from cleanroom.core.baseline_model import Baseline
from cleanroom.errors import CleanroomError, ConfigError
from cleanroom.server.keys import KeyRing, Limits, public

keys_app = typer.Typer(help="API keys of `cleanroom serve` (kept hashed in the home).")
err = Console(stderr=True)


def _progress(name: str) -> Callable[[str, str], None]:
    def progress(step: str, detail: str) -> None:
        print(f"template {name}: {step} {detail}", file=sys.stderr, flush=True)

    return progress


def _resolve(ref: str, name: str) -> Baseline:
    from cleanroom.baseline.resolve import resolve_or_build

    return resolve_or_build(ref, progress=_progress(name))


def _base() -> Baseline:
    """The built-in ``base``, built on first use; no lock written into the package's folder."""
    from cleanroom.baseline.builder import build
    from cleanroom.server.serving import BASE_SPEC

    return build(BASE_SPEC, _progress("base"), keep_lock=False)


def parse_templates(given: list[str]) -> dict[str, Callable[[], Baseline]]:
    """``NAME=BASELINE`` pairs (a name, digest, or baseline.toml / folder); ``base`` is the
    built-in default unless named here."""
    out: dict[str, Callable[[], Baseline]] = {"base": _base}
    for item in given:
        name, sep, ref = item.partition("=")
        if not sep or not name or not ref:
            raise ConfigError(f"--template {item!r}: expected NAME=BASELINE")
        out[name] = functools.partial(_resolve, ref, name)
    return out


def serve(
    host: Annotated[str, typer.Option(help="address to listen on (loopback by default)")] = (
        "127.0.0.1"
    ),
    port: Annotated[int, typer.Option(help="TCP port")] = 3000,
    template: Annotated[
        list[str] | None,
        typer.Option(help="NAME=BASELINE (name, digest or baseline.toml); repeatable"),
    ] = None,
    driver: Annotated[str, typer.Option(help="qemu | gvisor | fake | fake-snap")] = "qemu",
    max_sandboxes: Annotated[int, typer.Option(help="sandboxes alive at once, all keys")] = 64,
    per_key: Annotated[int, typer.Option(help="sandboxes alive at once per key")] = 16,
    creates_per_s: Annotated[float, typer.Option(help="creates a second per key")] = 5.0,
    burst: Annotated[int, typer.Option(help="creates a key may make at once")] = 10,
    max_body_mib: Annotated[int, typer.Option(help="largest request body (MiB)")] = 256,
    certfile: Annotated[str | None, typer.Option(help="TLS certificate (PEM)")] = None,
    keyfile: Annotated[str | None, typer.Option(help="TLS private key (PEM)")] = None,
    domain: Annotated[str | None, typer.Option(help="sandbox domain behind real DNS")] = None,
    forkable: Annotated[
        bool, typer.Option(help="sandboxes can pause and fork (docs/server.md: what it costs)")
    ] = True,
    openenv: Annotated[
        list[str] | None,
        typer.Option(
            help="NAME=ENV@TEMPLATE[#KWARGS-JSON]: the Gym env ENV (an id or module:Class) in "
            "VMs of TEMPLATE, served as the OpenEnv environment /openenv/NAME; repeatable"
        ),
    ] = None,
    openenv_sessions: Annotated[
        int, typer.Option(help="OpenEnv sessions alive at once, all keys (--per-key: each key)")
    ] = 16,
    openenv_lookahead: Annotated[
        int, typer.Option(help="episodes a WebSocket session keeps opened ahead (0-8)")
    ] = 0,
    openenv_idle_s: Annotated[
        float, typer.Option(help="an OpenEnv WebSocket session silent this long ends")
    ] = 600.0,
    openenv_max_message_kib: Annotated[
        int, typer.Option(help="largest OpenEnv message or HTTP body (KiB)")
    ] = 1024,
    ray: Annotated[
        str | None,
        typer.Option(
            help="place sandboxes on a Ray cluster's nodes: auto | ADDRESS (cleanroom[ray])"
        ),
    ] = None,
    ray_store: Annotated[
        str | None, typer.Option(help="with --ray: a store every node reaches (s3://…, a mount)")
    ] = None,
) -> None:
    """Serve E2B's API (control + envd) on one port: every sandbox is a cleanroom session."""
    from cleanroom.drivers import get_driver

    try:
        from cleanroom.server.serving import ServeOptions
        from cleanroom.server.serving import serve as run_server
    except ImportError as exc:  # the `serve` extra is not installed
        err.print(f"[bold red]error:[/] {exc}: pip install 'cleanroom[serve]'")
        raise typer.Exit(2) from exc

    try:
        templates = parse_templates(list(template or []))
        hub = None
        if openenv:
            try:
                from cleanroom.server.openenv.hub import HubConfig
            except ImportError as exc:  # the `gym` extra is not installed
                err.print(f"[bold red]error:[/] {exc}: pip install 'cleanroom[gym,serve]'")
                raise typer.Exit(2) from exc
            from cleanroom.server.openenv.spec import parse_specs

            hub = HubConfig(
                specs=parse_specs(openenv, templates),
                driver=get_driver(driver).name,
                max_sessions=openenv_sessions,
                lookahead=openenv_lookahead,
                idle_s=openenv_idle_s,
                max_message=openenv_max_message_kib * 1024,
            )
        opts = ServeOptions(
            host=host,
            port=port,
            templates=templates,
            driver=get_driver(driver),
            max_sandboxes=max_sandboxes,
            limits=Limits(per_key, creates_per_s, burst),
            max_body=max_body_mib * 1024 * 1024,
            certfile=certfile,
            keyfile=keyfile,
            domain=domain,
            forkable=forkable,
            openenv=hub,
            ray=ray,
            ray_store=ray_store,
        )
        if not KeyRing().list():
            err.print("[yellow]no API keys yet[/]: make one with `cleanroom keys create`")

        def ready(url: str) -> None:
            print(f"cleanroom serve: listening on {url}", file=sys.stderr, flush=True)

        asyncio.run(run_server(opts, ready))
    except CleanroomError as exc:
        err.print(f"[bold red]error:[/] {exc}")
        raise typer.Exit(2) from exc


@keys_app.command("create")
def keys_create(
    name: Annotated[str, typer.Option(help="a name to tell the key by")] = "",
) -> None:
    """Make a key; it is printed once (only its hash is kept)."""
    info, key = KeyRing().create(name)
    err.print(f"key {info.key_id} made; it is shown only now:")
    print(key)


@keys_app.command("list")
def keys_list() -> None:
    """The keys (ids and names, never the keys)."""
    for info in KeyRing().list():
        print(json.dumps(public(info)))


@keys_app.command("revoke")
def keys_revoke(key_id: Annotated[str, typer.Argument(help="the key's id (keys list)")]) -> None:
    """Revoke a key: its requests are 401 from now on."""
    if not KeyRing().revoke(key_id):
        err.print(f"[red]error:[/] no key {key_id}")
        raise typer.Exit(2)
    err.print(f"revoked {key_id}")
