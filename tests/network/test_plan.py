"""The guest address plan of a policy and the QEMU arguments built from it."""

from __future__ import annotations

import shlex

from cleanroom.agent import guestnet
from cleanroom.network.plan import MAX_NAMES, plan_for
from cleanroom.network.policy import Policy
from cleanroom.network.qemu_args import FDPASS, SANDBOX_NETWORKED, Attachment, netdev_args


def test_exact_names_get_a_synthetic_address_and_one_forward_per_port() -> None:
    policy = Policy.parse(
        ["a.test:443", "b.test:80", "a.test:8443", "*.wild.test:443", "10.0.0.0/8:5432"]
    )
    plan = plan_for(policy)
    assert plan.addresses == {"a.test": "10.0.2.128", "b.test": "10.0.2.129"}
    assert [(f.tag, f.guest_addr, f.guest_port, f.dest) for f in plan.forwards] == [
        ("proxy", guestnet.PROXY_ADDR, guestnet.PROXY_PORT, None),
        ("dns", guestnet.DNS_ADDR, 53, None),
        ("tcp-0", "10.0.2.128", 443, ("a.test", 443)),
        ("tcp-1", "10.0.2.129", 80, ("b.test", 80)),
        ("tcp-2", "10.0.2.128", 8443, ("a.test", 8443)),
    ]  # wildcards and networks: through the HTTP proxy only
    assert plan.forward("tcp-1") == plan.forwards[3] and plan.forward("nope") is None


def test_names_beyond_the_synthetic_range_are_connect_only() -> None:
    names = [f"n{i}.test:1" for i in range(MAX_NAMES + 2)]
    plan = plan_for(Policy.parse(names))
    assert len(plan.addresses) == MAX_NAMES
    assert max(plan.addresses.values(), key=lambda a: int(a.rsplit(".", 1)[1])) == "10.0.2.254"
    assert plan.connect_only == (f"n{MAX_NAMES}.test", f"n{MAX_NAMES + 1}.test")


def test_the_netdev_is_restricted_and_leads_only_to_the_helper() -> None:
    plan = plan_for(Policy.parse(["a.test:443"]))
    args = netdev_args(Attachment("cleanroom-env-0123456789abcdef-egress-x", plan.forwards))
    assert args[0] == "-netdev" and args[2:] == ["-device", "virtio-net-device,netdev=egress"]
    options = args[1].split(",guestfwd=")
    head = options[0].split(",")
    assert {"user", "id=egress", "restrict=on", "ipv6=off", "net=10.0.2.0/24"} <= set(head)
    assert not any(o.startswith(("hostfwd", "smb", "tftp")) for o in head)
    assert len(options) == 1 + len(plan.forwards)
    for option, fwd in zip(options[1:], plan.forwards, strict=True):
        where, _, command = option.partition("-cmd:")
        assert where == f"tcp:{fwd.guest_addr}:{fwd.guest_port}"
        argv = shlex.split(command)
        assert argv[1:] == [
            "-I",
            "-S",
            str(FDPASS),
            "cleanroom-env-0123456789abcdef-egress-x",
            fwd.tag,
        ]
    assert "spawn=allow" in SANDBOX_NETWORKED and "obsolete=deny" in SANDBOX_NETWORKED
