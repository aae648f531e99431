"""The private hivemind seams WorldLM uses (:mod:`worldlm_p2p.net.hivemind_compat`): this fails
loudly, naming the seam, when the pinned hivemind changes."""

import ast
from pathlib import Path

import worldlm_p2p
from worldlm_p2p.net import hivemind_compat

PACKAGE = Path(worldlm_p2p.__file__).parent


def test_every_seam_is_where_we_use_it():
    assert hivemind_compat.check() == []


def test_the_pinned_version_is_the_one_the_package_requires():
    pyproject = (PACKAGE.parent / "pyproject.toml").read_text()
    assert f'"hivemind=={hivemind_compat.PINNED}"' in pyproject


def test_rsa_key_from_der_round_trip():
    from hivemind.utils.crypto import RSAPrivateKey
    from cryptography.hazmat.primitives import serialization

    key = RSAPrivateKey()
    der = key._private_key.private_bytes(serialization.Encoding.DER, serialization.PrivateFormat.PKCS8,
                                         serialization.NoEncryption())
    back = hivemind_compat.rsa_key_from_der(der)
    assert back.get_public_key().to_bytes() == key.get_public_key().to_bytes()
    assert back.sign(b"x") and key.get_public_key().verify(b"x", back.sign(b"x"))


def test_private_hivemind_attributes_are_used_in_the_compat_module_only():
    """An attribute of a hivemind object that starts with ``_`` (``_outer_pipe``, ``_matchmaking``,
    ``_p2p``, ``_private_key``) appears nowhere else in the package."""
    private = {"_outer_pipe", "_inner_pipe", "_matchmaking", "_p2p", "_private_key", "_public_key",
               "potential_leaders"}
    bad = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "hivemind_compat.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and node.attr in private:
                bad.append(f"{path.relative_to(PACKAGE)}:{node.lineno}: .{node.attr}")
    assert not bad, bad
