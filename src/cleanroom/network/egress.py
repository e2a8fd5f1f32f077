"""An episode's egress as the controller runs it: its policy, its proxy, its evidence.

``check_manifests`` refuses a run before anything starts when a manifest asks for more network
than its baseline allows, or the driver cannot enforce an allowlist. ``Egress`` belongs to one
env: ``start()`` opens its proxy (the driver gets the ``Attachment``); every connection and DNS
query becomes a ledger event ``egress`` (secret values redacted); ``finish()`` closes the proxy
and returns ``network.jsonl`` (the same events, one per line) for the episode's logs.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from cleanroom.errors import LaunchError, NetworkPolicyError
from cleanroom.host.hostproc import marker
from cleanroom.network.events import NetEvent
from cleanroom.network.policy import Policy
from cleanroom.network.proxy import EgressProxy
from cleanroom.network.qemu_args import Attachment

if TYPE_CHECKING:
    from cleanroom.core.baseline_model import Baseline
    from cleanroom.drivers.base import Driver
    from cleanroom.evidence.manifest import Manifest
    from cleanroom.evidence.secrets import Redactor
    from cleanroom.ledger import Ledger

LOG_NAME = "network.jsonl"
REDACTED_FIELDS = ("dest", "reason", "address", "error")  # guest-influenced text


def episode_policy(baseline: Baseline, manifest: Manifest) -> Policy:
    """The allowlist an episode gets: its manifest's, if it narrows the baseline's; else the
    baseline's (empty: no network). NetworkPolicyError if the manifest asks for more."""
    allowed = Policy.parse(baseline.network or (), where="baseline network.allow")
    requested = manifest.network.allow if manifest.network is not None else None
    return allowed.narrowed(requested, who=f"episode {manifest.episode_id}")


def check_manifests(manifests: list[Manifest], baseline: Baseline, driver: Driver) -> None:
    """Refuse the run (one NetworkPolicyError naming every problem) before anything starts."""
    problems = []
    networked = False
    for manifest in manifests:
        try:
            policy = episode_policy(baseline, manifest)
        except NetworkPolicyError as exc:
            problems.append(str(exc).splitlines()[0] + "".join(f"; {p}" for p in exc.problems))
            continue
        networked = networked or bool(policy)
        if policy and manifest.group is not None:  # clones of a NIC-less snapshot
            problems.append(
                f"{manifest.episode_id}: a group's episodes fork from a snapshot without a NIC; "
                'give them "network": {"allow": []}'
            )
    if networked and not driver.capabilities.egress:
        problems.append(f"the {driver.name} driver cannot enforce an egress allowlist")
    if problems:
        raise NetworkPolicyError("network: nothing was run", problems)


class Egress:
    """One env's egress proxy, wired to the ledger."""

    def __init__(
        self,
        policy: Policy,
        *,
        ledger: Ledger,
        run_id: str,
        episode_id: str,
        env_id: str,
        redactor: Redactor | None = None,
        hosts: Mapping[str, str] | None = None,
    ) -> None:
        self.policy = policy
        self._ledger = ledger
        self._where = {"run_id": run_id, "episode_id": episode_id, "env_id": env_id}
        self._redactor = redactor
        self._lines: list[dict[str, Any]] = []
        self.proxy = EgressProxy(
            policy, name=f"{marker(env_id)}-egress", on_event=self._on_event, hosts=hosts
        )
        self._finished = False

    async def start(self) -> Attachment:
        return await self.proxy.start()

    def check_ready(self, hello: dict[str, Any]) -> None:
        """The guest must have configured its NIC (the agent says so in HELLO)."""
        network = hello.get("network") or {}
        if not network.get("address"):
            why = network.get("error") or "no NIC found (is virtio_net in the baseline's kernel?)"
            raise LaunchError(f"the guest did not configure its network: {why}")

    async def finish(self) -> dict[str, bytes]:
        """Close the proxy (open connections are cut and recorded); the episode's network log."""
        await self.aclose()
        text = "".join(json.dumps(line, sort_keys=True) + "\n" for line in self._lines)
        return {LOG_NAME: text.encode()}

    async def aclose(self) -> None:
        if not self._finished:
            self._finished = True
            await self.proxy.aclose()

    def summary(self) -> dict[str, Any]:
        """For the record's provenance: the allowlist and what happened, in counts."""
        events = self.proxy.events
        return {
            "allow": self.policy.entries(),
            "connections": sum(e.via != "dns" for e in events),
            "dns_queries": sum(e.via == "dns" for e in events),
            "denied": sum(not e.allowed for e in events),
            "events_dropped": self.proxy.dropped,
        }

    def _on_event(self, event: NetEvent) -> None:
        data = event.to_json()
        if self._redactor:
            for key in REDACTED_FIELDS:
                if isinstance(data.get(key), str):
                    data[key] = self._redactor.redact_text(data[key])
        self._lines.append(data)
        self._ledger.event("egress", **self._where, **data)
