"""PeerID against the libp2p peer-id specification's Ed25519 test vector."""

from __future__ import annotations

import pytest

from swarm.p2p import Identity, IdentityError, PeerID

# libp2p specs, peer-ids/peer-ids.md "Test vectors" (Ed25519); the PeerID is what go-, rust- and
# js-libp2p compute for that key.
SPEC_PRIVATE = bytes.fromhex(
    "080112407e0830617c4a7de83925dfb2694556b12936c477a0e1feb2e148ec9da60fee7d"
    "1ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e"
)
SPEC_PUBLIC = bytes.fromhex("080112201ed1e8fae2c4a144b8be8fd4b47bf3d3b34b871c3cacf6010f0e42d474fce27e")
SPEC_PEER_ID = "12D3KooWBtg3aaRMjxwedh83aGiUkwSxDwUZkzuJcfaqUmo7R3pq"


def test_spec_vector_private_key_gives_public_key_and_peer_id() -> None:
    identity = Identity.from_protobuf(SPEC_PRIVATE)
    assert identity.to_protobuf() == SPEC_PRIVATE
    assert identity.peer_id.to_bytes() == bytes([0x00, len(SPEC_PUBLIC)]) + SPEC_PUBLIC
    assert str(identity.peer_id) == SPEC_PEER_ID
    assert identity.peer_id.public_key() == SPEC_PUBLIC[4:]


def test_parse_format_round_trip_and_ed25519_prefix() -> None:
    peer = Identity.generate().peer_id
    assert str(peer).startswith("12D3KooW")
    assert PeerID.from_base58(str(peer)) == peer
    assert PeerID(peer.to_bytes()) == peer


def test_equality_hash_order() -> None:
    a, b = PeerID.from_base58(SPEC_PEER_ID), PeerID.from_base58(SPEC_PEER_ID)
    c = Identity.generate().peer_id
    assert a == b and hash(a) == hash(b) and len({a, b, c}) == 2
    assert (a < c) == (a.to_bytes() < c.to_bytes())
    assert sorted([c, a]) == sorted([a, c])
    assert a != SPEC_PEER_ID  # a PeerID never equals its text


def test_dht_id_is_160_bits_and_stable() -> None:
    peer = PeerID.from_base58(SPEC_PEER_ID)
    assert 0 <= peer.dht_id < 2**160
    assert peer.dht_id == PeerID.from_base58(SPEC_PEER_ID).dht_id
    assert peer.dht_id != Identity.generate().peer_id.dht_id


def test_hashed_ids_parse_but_have_no_inline_key() -> None:
    rsa_style = "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"  # sha2-256 multihash id
    peer = PeerID.from_base58(rsa_style)
    assert str(peer) == rsa_style
    with pytest.raises(IdentityError, match="hashed"):
        peer.public_key()


@pytest.mark.parametrize("text", ["", "0OIl", "12D3KooW", "x" * 500, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx"])
def test_malformed_peer_ids_are_refused(text: str) -> None:
    with pytest.raises(IdentityError):
        PeerID.from_base58(text)


def test_a_decoded_text_is_decoded_once_and_a_bad_one_fails_each_time() -> None:
    """Records name their owners in base58 and are validated at every read: one decode a text."""
    text = Identity.generate().peer_id.to_base58()
    assert PeerID.from_base58(text) is PeerID.from_base58(text)
    for _ in range(2):
        with pytest.raises(IdentityError):
            PeerID.from_base58("0OIl")
