"""Egress allowlists: parsing, matching destinations, and the narrowing rule."""

from __future__ import annotations

import pytest

from cleanroom.errors import NetworkPolicyError
from cleanroom.network.policy import Policy, Rule, normalize_name, split_target


@pytest.mark.parametrize(
    ("text", "kind", "host", "port", "canonical"),
    [
        ("api.example.com:443", "name", "api.example.com", 443, "api.example.com:443"),
        ("API.Example.COM.:443", "name", "api.example.com", 443, "api.example.com:443"),
        ("*.example.internal:443", "wildcard", "example.internal", 443, "*.example.internal:443"),
        ("10.1.2.3:5432", "net", "10.1.2.3/32", 5432, "10.1.2.3:5432"),
        ("10.0.0.0/8:5432", "net", "10.0.0.0/8", 5432, "10.0.0.0/8:5432"),
        ("[fd00::1]:443", "net", "fd00::1/128", 443, "[fd00::1]:443"),
        ("[fd00::/8]:443", "net", "fd00::/8", 443, "[fd00::/8]:443"),
        ("localhost:8080", "name", "localhost", 8080, "localhost:8080"),
    ],
)
def test_entries_parse_to_rules(text: str, kind: str, host: str, port: int, canonical: str) -> None:
    rule = Rule.parse(text)
    assert (rule.kind, rule.host, rule.port) == (kind, host, port)
    assert str(rule) == canonical
    assert Rule.parse(str(rule)) == rule


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("example.com", "HOST:PORT"),
        ("example.com:0", "1-65535"),
        ("example.com:65536", "1-65535"),
        ("example.com:https", "1-65535"),
        (":443", "empty host"),
        ("*:443", "not a DNS name"),
        ("a.*.example.com:443", "not a DNS name"),
        ("*.*.example.com:443", "wildcard"),
        ("10.0.0.1/8:443", "host bits set"),
        ("300.1.1.1:443", "not an address"),
        ("fd00::1:443", "brackets"),
        ("127.1:80", "not an address"),
        ("2130706433:80", "not an address"),
        ("-bad-.example.com:443", "not a DNS name"),
        ("under score ok:1", "not a DNS name"),
    ],
)
def test_bad_entries_are_refused_with_a_reason(text: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        Rule.parse(text)


def test_a_policy_lists_every_bad_entry_and_drops_duplicates() -> None:
    with pytest.raises(NetworkPolicyError) as info:
        Policy.parse(["ok.example:1", "bad", "also bad:x"])
    assert [p.split(" ")[0] for p in info.value.problems] == ["allow[1]", "allow[2]"]
    policy = Policy.parse(["a.example:1", "A.example.:1", "a.example:2"])
    assert policy.entries() == ["a.example:1", "a.example:2"]
    assert not Policy() and policy


def test_matching_names_wildcards_addresses_and_ports() -> None:
    policy = Policy.parse(
        ["api.example.com:443", "*.svc.internal:8080", "10.0.0.0/8:5432", "[fd00::/8]:443"]
    )
    allowed = [
        ("api.example.com", 443),
        ("API.EXAMPLE.COM.", 443),
        ("db.svc.internal", 8080),
        ("a.b.svc.internal", 8080),
        ("10.200.3.4", 5432),
        ("[fd00::5]", 443),
        ("fd00::5", 443),
    ]
    denied = [
        ("api.example.com", 80),  # wrong port
        ("evil.api.example.com", 443),  # an exact name allows no subdomain
        ("svc.internal", 8080),  # a wildcard does not match its own suffix
        ("xsvc.internal", 8080),  # nor a name that merely ends like it
        ("11.0.0.1", 5432),
        ("10.0.0.1", 5433),
        ("fe80::1", 443),
        ("127.0.0.1", 443),
        ("2130706433", 5432),  # decimal 127.0.0.1: neither a name nor an address here
        ("not a name", 443),
    ]
    for host, port in allowed:
        assert policy.match(host, port) is not None, (host, port)
    for host, port in denied:
        assert policy.match(host, port) is None, (host, port)


def test_names_never_match_address_rules_and_addresses_never_match_names() -> None:
    assert Policy.parse(["10.0.0.0/8:443"]).match("ten.example", 443) is None
    assert Policy.parse(["*.in-addr.arpa:443"]).match("10.0.0.1", 443) is None


def test_a_manifest_may_narrow_its_baseline() -> None:
    base = Policy.parse(
        ["api.example.com:443", "*.svc.internal:8080", "10.0.0.0/8:5432", "pypi.org:443"]
    )
    assert base.narrowed(None) is base  # nothing asked: the baseline's policy
    assert not base.narrowed([])  # an empty list turns the network off
    narrowed = base.narrowed(
        ["api.example.com:443", "db.svc.internal:8080", "*.x.svc.internal:8080", "10.1.0.0/16:5432"]
    )
    assert narrowed.entries() == [
        "api.example.com:443",
        "db.svc.internal:8080",
        "*.x.svc.internal:8080",
        "10.1.0.0/16:5432",
    ]
    assert base.narrowed(["*.svc.internal:8080", "10.2.3.4:5432"])


@pytest.mark.parametrize(
    "wider",
    [
        "api.example.com:80",  # another port
        "evil.example.com:443",
        "*.example.com:443",  # a wildcard is wider than one name
        "svc.internal:8080",  # the wildcard's own suffix is not below it
        "*.internal:8080",
        "0.0.0.0/0:5432",
        "11.0.0.1:5432",
        "[::ffff:10.0.0.1]:5432",  # IPv6 never fits an IPv4 network
    ],
)
def test_a_manifest_may_not_widen_its_baseline(wider: str) -> None:
    base = Policy.parse(["api.example.com:443", "*.svc.internal:8080", "10.0.0.0/8:5432"])
    with pytest.raises(NetworkPolicyError, match="does not allow") as info:
        base.narrowed(["api.example.com:443", wider], who="episode e1")
    message = str(info.value)
    assert "episode e1" in message and str(Rule.parse(wider)) in message
    assert "api.example.com:443," not in message.split("allow:")[1].split("(")[0]


def test_no_network_in_the_baseline_means_none_for_its_manifests() -> None:
    with pytest.raises(NetworkPolicyError, match="its baseline allows none"):
        Policy().narrowed(["api.example.com:443"])
    assert not Policy().narrowed([]) and not Policy().narrowed(None)


def test_helpers() -> None:
    assert split_target("[::1]:80") == ("::1", 80)
    assert split_target("a.b:1") == ("a.b", 1)
    assert normalize_name("Example.COM.") == "example.com"
    assert normalize_name("a" * 64 + ".com") is None
    assert normalize_name("x.123") is None
    assert normalize_name("") is None
