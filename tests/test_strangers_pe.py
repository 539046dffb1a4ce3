"""Issue 24, the remote PE and a stranger's workflow: where a bound key may go (the path too), whose words an error may
quote, what a refusal tells about the user's environment, whose texts the result cache serves, and who may read it.

Against the real ``transformers serve`` behind a recording proxy, and the fault server for the answers a real server
will not give (named so). Every server here listens on loopback: the quoting rule is tested on addresses, and end to
end through ``http://127.1:<port>``, a name for the loopback fault server that the rule (which resolves no names)
does not take for this machine, as it would not take a host on the user's network."""

from __future__ import annotations

import os
import stat

import folder_paths
import pytest

from comfyui_ernie_image.nodes.pe.cache import ResultCache, enhance_cached
from comfyui_ernie_image.nodes.pe.nodes import ErnieImagePERemote, ErnieImagePromptEnhance, result_cache
from comfyui_ernie_image.nodes.pe.protocol import Completion, EnhancerError, PromptSpec, SamplingParams
from comfyui_ernie_image.nodes.pe.remote.key_policy import trusted_server
from comfyui_ernie_image.nodes.pe.remote.url import is_loopback, parse_api_root
from helpers.pe_servers import RecordingProxy, Reply, key_not_sent, models_reply, remote

PROMPT = [PromptSpec("a red kite over the sea", 1024, 1024)]
SAMPLED = SamplingParams(temperature=0.6, top_p=0.8, max_new_tokens=16, seed=5)
KEY, SECRET = "ERNIE_PE_API_KEY_STRANGER", "sk-stranger-0123456789"
NOT_SENT = key_not_sent(KEY)
UNQUOTED = ("its own words are not shown: only a server on this machine or the one an api_key_env key is bound to "
            "is quoted")


def remote_node(base_url: str, api_key_env: str = "", model: str = ""):
    """The handle the workflow's remote PE node makes."""
    return ErnieImagePERemote.execute(base_url, model, api_key_env, 60.0, 0).result[0]


# --- a key bound to a path -----------------------------------------------------------------------------------------


def test_a_key_bound_to_a_gateway_path_goes_to_that_path_only(pe_server, monkeypatch):
    """On main the binding compared the origin alone: a workflow's ``/attacker/v1`` on the bound gateway got the
    key."""
    with RecordingProxy(pe_server, prefix="/team-a/v1") as gateway:
        monkeypatch.setenv(KEY, SECRET)
        monkeypatch.setenv(f"{KEY}_URL", f"{gateway.url}/team-a")
        (completion,) = remote_node(f"{gateway.url}/team-a/v1", KEY).enhance(PROMPT, SAMPLED)
        assert completion.text
        assert {r.headers["Authorization"] for r in gateway.received} == {f"Bearer {SECRET}"}
        sent = len(gateway.received)
        for elsewhere in ("/attacker/v1", "/team-ab/v1", "/v1", "", "/team/a/v1"):
            with pytest.raises(EnhancerError) as error:
                remote_node(gateway.url + elsewhere, KEY)
            assert str(error.value) == NOT_SENT, elsewhere
        assert len(gateway.received) == sent  # nothing more reached the gateway


# --- one refusal, whatever the environment holds ------------------------------------------------------------------


def test_unset_unbound_and_misbound_keys_are_refused_in_the_same_words(monkeypatch):
    """On main the words told an unset key from one without _URL, and named the server a key is bound to: a
    stranger's workflow learned what the user's environment holds."""
    url = "http://127.0.0.1:9"  # nothing listens: every refusal comes before a request
    said = []
    monkeypatch.delenv(KEY, raising=False)
    monkeypatch.delenv(f"{KEY}_URL", raising=False)
    for setting in ({}, {KEY: SECRET}, {f"{KEY}_URL": url}, {KEY: SECRET, f"{KEY}_URL": "https://pe.internal.example"},
                    {KEY: SECRET, f"{KEY}_URL": f"{url}/other"}):
        with monkeypatch.context() as env:
            for name, value in setting.items():
                env.setenv(name, value)
            with pytest.raises(EnhancerError) as error:
                remote_node(url, KEY)
            said.append(str(error.value))
    assert said == [NOT_SENT] * 5
    assert not any("internal" in text or "/other" in text for text in said)


# --- whose words an error may quote --------------------------------------------------------------------------------


@pytest.mark.parametrize(("host", "loopback"), [
    ("127.0.0.1", True), ("127.3.4.5", True), ("::1", True), ("localhost", True), ("localhost.", True),
    ("::ffff:127.0.0.1", True),
    ("10.0.0.5", False), ("192.168.1.2", False), ("169.254.169.254", False), ("pe.example.com", False),
    ("0.0.0.0", False), ("::ffff:10.0.0.1", False), ("localhost.example.com", False), ("127.1", False),
    ("127.0.0.1.nip.io", False), ("::", False),
])
def test_only_this_machine_by_its_address_counts_as_loopback(host, loopback):
    """Judged by the written address, never by resolving a name (what a name resolves to can change)."""
    assert is_loopback(host) is loopback


def test_a_server_is_quoted_when_on_this_machine_or_bound_to_the_key(monkeypatch):
    monkeypatch.setenv(KEY, SECRET)
    monkeypatch.setenv(f"{KEY}_URL", "https://pe.example.com/team")
    assert trusted_server(parse_api_root("http://127.0.0.1:8000"), "")
    assert trusted_server(parse_api_root("https://pe.example.com/team/v1"), KEY)
    assert not trusted_server(parse_api_root("https://pe.example.com/other/v1"), KEY)
    assert not trusted_server(parse_api_root("https://pe.example.com/team/v1"), "")  # no key: any host
    assert not trusted_server(parse_api_root("http://10.0.0.5:8080"), "")


def _stranger(fault) -> str:
    return f"http://127.1:{fault.port}"


def test_another_hosts_error_text_is_not_quoted_fault_server(fault):
    """On main any host's JSON error message (200 characters) reached ComfyUI's error: a workflow's base_url aimed at
    a service on the user's network read its answers back."""
    fault.default = Reply(status=400, body={"error": {"message": "internal: db password is hunter2"}})
    with pytest.raises(EnhancerError) as error:
        remote(_stranger(fault), model="pe", max_retries=0).enhance(PROMPT, SAMPLED)
    assert str(error.value) == (f"{_stranger(fault)}/v1/chat/completions answered HTTP 400 ({UNQUOTED}) (check "
                                "base_url and the model name 'pe')")
    with pytest.raises(EnhancerError, match="answered HTTP 400: internal: db password is hunter2 "):
        remote(fault.url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)  # 127.0.0.1: this machine's own


@pytest.mark.parametrize("reply", [
    Reply(status=401, body={"detail": "internal realm hunter2"}),
    Reply(status=302, headers={"Location": "http://sso.hunter2.internal/login"}),
    Reply(body="<html>hunter2</html>", headers={"Content-Type": "text/hunter2"}),
    Reply(body={"choices": [{"message": {"content": ""}, "finish_reason": "hunter2"}]}),
])
def test_no_header_or_field_of_another_host_reaches_an_error_fault_server(fault, reply):
    """The redirect's target, the content type, finish_reason: the host's words too."""
    fault.default = reply
    with pytest.raises(EnhancerError) as error:
        remote(_stranger(fault), model="pe", max_retries=0).enhance(PROMPT, SAMPLED)
    assert _stranger(fault) in str(error.value) and "hunter2" not in str(error.value), str(error.value)
    with pytest.raises(EnhancerError, match="hunter2"):
        remote(fault.url, model="pe", max_retries=0).enhance(PROMPT, SAMPLED)


def test_the_model_another_host_lists_is_not_echoed_fault_server(fault):
    fault.models = models_reply({"id": "hunter2-internal-model", "object": "model"})
    fault.default = Reply(status=404, body={})
    with pytest.raises(EnhancerError) as error:
        remote(_stranger(fault), max_retries=0).enhance(PROMPT, SAMPLED)
    assert "hunter2" not in str(error.value)
    assert str(error.value).endswith(f"({UNQUOTED}) (check base_url, and give the model name in 'model')")


# --- whose texts the cache serves -----------------------------------------------------------------------------------


def test_a_run_without_the_key_does_not_read_texts_a_keyed_run_paid_for(pe_server, tmp_path, monkeypatch):
    """On main the cache key left the credential out: the same server, prompt and seed without the key was served
    the keyed run's text from the cache."""
    cache = ResultCache(tmp_path / "pe_cache.sqlite3")
    with RecordingProxy(pe_server) as server:
        monkeypatch.setenv(KEY, SECRET)
        monkeypatch.setenv(f"{KEY}_URL", server.url)
        keyed, keyless = remote_node(server.url, KEY), remote_node(server.url)
        enhance_cached(keyed, PROMPT, SAMPLED, cache)
        enhance_cached(keyless, PROMPT, SAMPLED, cache)
        assert len(server.chats) == 2  # asked again: not the keyed run's stored text
        enhance_cached(keyed, PROMPT, SAMPLED, cache)
        assert len(server.chats) == 2  # the keyed run's own text is still cached for it
        keyed_identity, keyless_identity = keyed.identity, keyless.identity
        monkeypatch.setenv(KEY, SECRET + "-rotated")
        rotated_identity = keyed.identity
    assert SECRET not in keyed_identity and len({keyed_identity, keyless_identity, rotated_identity}) == 3


# --- who may read the cache ----------------------------------------------------------------------------------------


def _mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture
def umask_022():
    """The usual umask, under which main's file was readable by every user of the machine."""
    before = os.umask(0o022)
    yield
    os.umask(before)


def test_the_cache_file_is_private_also_when_it_was_not(tmp_path, umask_022):
    """On main the file took the umask's 0644 (readable by every user of the machine) and the folder 0755."""
    folder = tmp_path / "ernie"
    new = ResultCache(folder / "pe_cache.sqlite3")
    new.put("k", Completion("a text"))
    assert (_mode(folder), _mode(folder / "pe_cache.sqlite3")) == (0o700, 0o600)
    os.chmod(folder, 0o755)
    os.chmod(folder / "pe_cache.sqlite3", 0o644)
    old = ResultCache(folder / "pe_cache.sqlite3")
    assert old.get("k").text == "a text"  # the same file, now private
    assert (_mode(folder), _mode(folder / "pe_cache.sqlite3")) == (0o700, 0o600)


def test_the_nodes_cache_lives_in_a_system_user_folder_fault_server(fault, tmp_path, monkeypatch, umask_022):
    """ComfyUI serves no ``__`` folder over /userdata; on main the file was ``user/ernie_image/pe_cache.sqlite3``,
    0644. A file there from an earlier version is moved, with its texts."""
    monkeypatch.setattr(folder_paths, "user_directory", str(tmp_path))
    former = tmp_path / "ernie_image" / "pe_cache.sqlite3"
    former.parent.mkdir()
    ResultCache(former).put("from-before", Completion("kept"))
    os.chmod(former, 0o644)
    inode = former.stat().st_ino
    result_cache.cache_clear()
    try:
        values = {"width": 1024, "height": 1024, "enabled": True, "temperature": 0.6, "top_p": 0.8,
                  "max_new_tokens": 16, "seed": 0}
        ErnieImagePromptEnhance.execute(prompt=["a cat"], pe=[remote(fault.url, model="pe")],
                                        **{k: [v] for k, v in values.items()})
        path = tmp_path / "__ernie_image" / "pe_cache.sqlite3"
        assert (_mode(path.parent), _mode(path)) == (0o700, 0o600)
        assert path.stat().st_ino == inode and not former.exists()
        assert result_cache().get("from-before").text == "kept"
    finally:
        result_cache.cache_clear()
