"""CURVE from configuration: key files or inline z85 keys, generated keys, plain data for a child."""

from __future__ import annotations

import msgspec
import pytest
import trio
import zmq
import zmq.auth

from transports import CurveConfig, HubOptions, open_hub

from .conftest import Note
from .monitors import ADMITTED, REFUSED_KEY, events_of


@pytest.fixture
def certificates(tmp_path):
    """zmq.auth certificate files: a shared keypair 'tercet' that admits itself, and an intruder's."""
    keys = tmp_path / "keys"
    authorized = tmp_path / "authorized"
    keys.mkdir()
    authorized.mkdir()
    public, secret = zmq.auth.create_certificates(keys, "tercet")
    (authorized / "tercet.key").write_bytes((keys / "tercet.key").read_bytes())
    _, intruder_secret = zmq.auth.create_certificates(keys, "intruder")
    return {"public": public, "secret": secret, "authorized": str(authorized), "intruder": intruder_secret}


def from_files(certificates) -> CurveConfig:
    return CurveConfig(secret_file=certificates["secret"], server_public_file=certificates["public"],
                       authorized_dir=certificates["authorized"])


async def talk_and_refuse(config: CurveConfig, intruder: CurveConfig) -> None:
    """Two hubs with ``config`` talk over tcp; a hub with ``intruder`` is refused by the receiver."""
    async with open_hub(curve=config) as server, open_hub(curve=config) as client, \
            open_hub(curve=intruder) as stranger:
        receiver = await server.bind("tcp://127.0.0.1:0", Note)
        async with events_of(receiver._sock) as next_outcome:
            with trio.fail_after(10):  # a bound that fails; every wait below is on an event
                refused = await stranger.connect(receiver.address)
                await refused.send(Note(9, 9))
                assert await next_outcome() == REFUSED_KEY
                async with await client.connect(receiver.address) as sender:
                    await sender.send(Note(0, 1))
                    while (outcome := await next_outcome()) != ADMITTED:
                        assert outcome == REFUSED_KEY  # the intruder retrying
                    assert await receiver.receive() == Note(0, 1)  # and the intruder's never
            with trio.move_on_after(0):
                await refused.aclose()  # never acknowledged: a cancelled close abandons it
        await receiver.aclose()


async def test_keys_from_certificate_files(certificates):
    config = from_files(certificates)
    intruder = CurveConfig(secret_file=certificates["intruder"], server_public_file=certificates["public"])
    await talk_and_refuse(config, intruder)


async def test_a_keypair_generated_at_start_secures_the_processes_of_one_host():
    config = CurveConfig.generate()
    other = CurveConfig.generate()
    # the intruder knows the server's public key but has a keypair of its own
    intruder = CurveConfig(secret_key=other.secret_key, server_key=config.server_key)
    await talk_and_refuse(config, intruder)


async def test_inline_keys_and_files_mix(certificates):
    """A receiver admits the keys of its directory and the inline ones."""
    guest = CurveConfig.generate()
    public = zmq.auth.load_certificate(certificates["public"])[0].decode()
    server = CurveConfig(secret_file=certificates["secret"], authorized_dir=certificates["authorized"],
                         authorized_keys=(guest.server_key,))
    async with open_hub(curve=server) as hub, \
            open_hub(curve=CurveConfig(secret_key=guest.secret_key, server_key=public)) as guest_hub, \
            open_hub(curve=from_files(certificates)) as member_hub:
        receiver = await hub.bind("tcp://127.0.0.1:0", Note)
        with trio.fail_after(10):
            for n, peer in enumerate((guest_hub, member_hub)):
                async with await peer.connect(receiver.address) as sender:
                    await sender.send(Note(n, n))
                assert await receiver.receive() == Note(n, n)
        await receiver.aclose()


@pytest.mark.parametrize("make", ["files", "generated"])
def test_hub_options_are_plain_data_that_survive_json(certificates, make):
    curve = from_files(certificates) if make == "files" else CurveConfig.generate()
    options = HubOptions(curve=curve, max_message_bytes=1 << 20, allow_insecure=True)
    wire = msgspec.json.encode(options)
    assert msgspec.json.decode(wire, type=HubOptions) == options
    assert msgspec.convert(msgspec.to_builtins(options), HubOptions) == options


def test_paths_are_stored_as_text_and_the_secret_key_is_not_shown(tmp_path):
    config = CurveConfig(secret_file=tmp_path / "a.key_secret", authorized_dir=tmp_path)
    assert config.secret_file == str(tmp_path / "a.key_secret") and config.authorized_dir == str(tmp_path)
    generated = CurveConfig.generate()
    assert generated.secret_key not in repr(generated) and generated.server_key in repr(generated)


def test_bad_configs_are_refused_with_what_is_wrong(certificates):
    key = CurveConfig.generate().server_key
    with pytest.raises(ValueError, match="secret_file or secret_key, not both"):
        CurveConfig(secret_file=certificates["secret"], secret_key=key)
    with pytest.raises(ValueError, match="server_public_file or server_key, not both"):
        CurveConfig(server_public_file=certificates["public"], server_key=key)
    with pytest.raises(ValueError, match="authorized_keys.*not a z85 CURVE key"):
        CurveConfig(secret_key=key, authorized_keys=("not-a-key",))
    with pytest.raises(ValueError, match="holds no secret key"):
        CurveConfig(secret_file=certificates["public"]).load()
    with pytest.raises(ValueError, match="not a directory"):
        CurveConfig(secret_key=key, authorized_dir=certificates["public"]).load()
    with pytest.raises(ValueError, match="keys are missing"):
        CurveConfig(server_key=key).load()
    with pytest.raises(ValueError, match="max_message_bytes"):
        HubOptions(max_message_bytes=0)


async def test_a_receiver_without_admitted_keys_and_a_sender_without_a_server_key_are_refused():
    key = CurveConfig.generate()
    async with open_hub(curve=CurveConfig(secret_key=key.secret_key)) as hub:
        with pytest.raises(ValueError, match="authorized_dir or authorized_keys"):
            await hub.bind("tcp://127.0.0.1:0", Note)
        with pytest.raises(ValueError, match="server_public_file or server_key"):
            await hub.connect("tcp://127.0.0.1:5555")


async def test_open_hub_keywords_override_the_options():
    options = HubOptions(max_message_bytes=1000)
    async with open_hub(options, allow_insecure=True) as hub:
        assert hub.options == HubOptions(max_message_bytes=1000, allow_insecure=True)
    async with open_hub() as hub:
        assert hub.options == HubOptions()
