"""scripts/netemu.py without namespaces: rate parsing, argument checks, and the one-line
refusal without privileges. The emulator itself (root): tests/tools/test_netemu.py."""

import pytest

from scripts import netemu
from scripts.netemu import Emulator


def test_parse_rate():
    assert netemu.parse_rate("100mbit") == 100_000_000
    assert netemu.parse_rate("1gbit") == 1_000_000_000
    assert netemu.parse_rate("12.5mbps") == 100_000_000  # tc: bps = bytes/s
    assert netemu.parse_rate(5e6) == 5_000_000
    for bad in ("fast", "-1mbit", "0", "10 furlongs", True):
        with pytest.raises(ValueError, match="rate"):
            netemu.parse_rate(bad)


def test_without_privileges_fails_clearly(monkeypatch, capsys):
    monkeypatch.setattr(netemu, "check_privileges", lambda: (False, "netemu " + netemu.NEED_PRIVILEGES))
    with pytest.raises(PermissionError, match="CAP_NET_ADMIN"):
        Emulator(2).up()
    assert netemu.main(["measure"]) == 1
    assert "needs root/CAP_NET_ADMIN" in capsys.readouterr().err


def test_bad_arguments():
    with pytest.raises(ValueError, match="nodes"):
        Emulator(0)
    with pytest.raises(ValueError, match="subnet"):
        Emulator(2, subnet="8.8.8.0/24")
    with pytest.raises(ValueError, match="qdisc"):
        Emulator(2, qdisc="netem")

