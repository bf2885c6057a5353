"""The connection options of the modules that reach the API server: kubernetes.core's, all of them (compared with
its own args_common.py, which tests/setup.sh fetches into .build/), documented once, read from the environment as
kubernetes.core reads them, and each set where the ``kubernetes`` client takes it."""
from __future__ import annotations

import base64
import os
import runpy

import pytest
import yaml

from ansible_collections.gpuckpt.fleet.plugins.doc_fragments.k8s_auth import ModuleDocFragment
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s import api as k8s_api
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.api import AUTH_ARG_SPEC, AUTH_ENV, auth_args
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.api import AUTH_PROXY_HEADERS_ENV

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
KUBERNETES_CORE_ARGS = os.path.join(REPO, ".build", "kubernetes.core", "args_common.py")


@pytest.fixture(scope="module")
def kubernetes_core():
    """kubernetes.core's args_common.py (a file of plain dicts), run on its own: its AUTH_ARG_SPEC,
    AUTH_PROXY_HEADERS_SPEC and AUTH_ARG_MAP."""
    if not os.path.isfile(KUBERNETES_CORE_ARGS):
        pytest.skip("kubernetes.core's args_common.py is not in .build/ (tests/setup.sh fetches it from the ansible "
                    "package); the spec cannot be compared with the real one here")
    return runpy.run_path(KUBERNETES_CORE_ARGS)


def normalized(spec):
    """An argument spec as AnsibleModule reads it: no type is ``str``, no no_log is False, no aliases is []."""
    out = {}
    for name, option in spec.items():
        out[name] = {"type": option.get("type", "str"), "aliases": sorted(option.get("aliases", [])),
                     "no_log": bool(option.get("no_log", False)), "elements": option.get("elements"),
                     "options": normalized(option["options"]) if option.get("options") else None}
    return out


def test_the_options_are_kubernetes_cores_all_of_them(kubernetes_core):
    assert normalized(AUTH_ARG_SPEC) == normalized(kubernetes_core["AUTH_ARG_SPEC"])
    assert normalized(AUTH_ARG_SPEC["proxy_headers"]["options"]) == normalized(kubernetes_core["AUTH_PROXY_HEADERS_SPEC"])


def test_the_environment_variables_are_kubernetes_cores(kubernetes_core):
    """kubernetes.core reads K8S_AUTH_<option>, then K8S_AUTH_<the client's name> for the options of its
    AUTH_ARG_MAP, and K8S_AUTH_<option> for the impersonation (its module_utils/k8s/client.py)."""
    expected = {}
    for client_name, option in kubernetes_core["AUTH_ARG_MAP"].items():
        expected[option] = tuple(dict.fromkeys(("K8S_AUTH_" + option.upper(), "K8S_AUTH_" + client_name.upper())))
    for option in ("impersonate_user", "impersonate_groups"):
        expected[option] = ("K8S_AUTH_" + option.upper(),)
    del expected["proxy_headers"]  # read as one variable per suboption
    assert AUTH_ENV == expected
    assert sorted(AUTH_PROXY_HEADERS_ENV.values()) == sorted(
        "K8S_AUTH_PROXY_HEADERS_" + key.upper() for key in kubernetes_core["AUTH_PROXY_HEADERS_SPEC"])


def test_the_doc_fragment_documents_exactly_the_options_the_modules_take():
    documented = yaml.safe_load(ModuleDocFragment.DOCUMENTATION)["options"]

    def check(doc, spec, env):
        assert sorted(doc) == sorted(spec)
        for name, option in spec.items():
            assert doc[name]["type"] == option["type"], name
            assert doc[name].get("aliases", []) == option.get("aliases", []), name
            assert doc[name].get("elements") == option.get("elements"), name
            description = doc[name]["description"]
            text = " ".join(description if isinstance(description, list) else [description])
            for variable in env.get(name, ()):
                assert "E(%s)" % variable in text, (name, variable)

    check(documented, AUTH_ARG_SPEC, AUTH_ENV)
    check(documented["proxy_headers"]["suboptions"], AUTH_ARG_SPEC["proxy_headers"]["options"],
          {key: (env,) for key, env in AUTH_PROXY_HEADERS_ENV.items()})


def test_the_secrets_are_never_logged():
    secret = {name for name, option in AUTH_ARG_SPEC.items() if option.get("no_log")}
    assert secret == {"kubeconfig", "api_key", "password"}
    assert {name for name, option in AUTH_ARG_SPEC["proxy_headers"]["options"].items() if option.get("no_log")} == {
        "proxy_basic_auth", "basic_auth"}


def test_each_module_gets_its_own_copy_of_the_spec():
    """AnsibleModule may add to a spec it is given; one module's must never reach another's."""
    mine = auth_args()
    mine["validate_certs"]["aliases"].append("insecure")
    mine["host"]["required"] = True
    mine["proxy_headers"]["options"]["user_agent"]["default"] = "me"
    assert auth_args() == AUTH_ARG_SPEC and "insecure" not in AUTH_ARG_SPEC["validate_certs"]["aliases"]


@pytest.fixture
def no_k8s_environment(monkeypatch):
    for name in list(os.environ):
        if name.startswith("K8S_AUTH_") or name == "KUBERNETES_SERVICE_HOST":
            monkeypatch.delenv(name)
    return monkeypatch


def test_an_option_not_given_is_read_from_the_environment_as_kubernetes_core_reads_it(no_k8s_environment):
    env = no_k8s_environment
    env.setenv("K8S_AUTH_VERIFY_SSL", "No")            # the client's name, when the option's own is not set
    env.setenv("K8S_AUTH_SSL_CA_CERT", "/ca-alias.pem")
    env.setenv("K8S_AUTH_CA_CERT", "/ca.pem")           # the option's own name first
    env.setenv("K8S_AUTH_IMPERSONATE_GROUPS", "ops,,gpu-admins")
    env.setenv("K8S_AUTH_PERSIST_CONFIG", "yes")
    env.setenv("K8S_AUTH_PROXY_HEADERS_USER_AGENT", "gpuckpt/1")
    options = k8s_api.connection_options({"host": "https://given:6443"})
    assert options["validate_certs"] is False and options["persist_config"] is True
    assert options["ca_cert"] == "/ca.pem" and options["host"] == "https://given:6443"
    assert options["impersonate_groups"] == ["ops", "gpu-admins"]
    assert options["proxy_headers"] == {"user_agent": "gpuckpt/1"}
    assert options["username"] is None and options["proxy"] is None
    # a parameter given wins over the environment, proxy_headers as a whole
    given = k8s_api.connection_options({"validate_certs": True, "proxy_headers": {"basic_auth": "a:b"}})
    assert given["validate_certs"] is True and given["proxy_headers"] == {"basic_auth": "a:b"}


def test_every_option_is_set_where_the_kubernetes_client_takes_it(no_k8s_environment):
    api = k8s_api.api_client({
        "host": "https://api.example:6443/", "username": "admin", "password": "s3cret", "validate_certs": False,
        "ca_cert": "/ca.pem", "client_cert": "/me.crt", "client_key": "/me.key", "proxy": "http://proxy:3128",
        "no_proxy": "localhost,.cluster.local", "proxy_headers": {"proxy_basic_auth": "p:q", "user_agent": "x/1"},
        "impersonate_user": "alice", "impersonate_groups": ["ops"]})
    cfg = api.configuration
    assert cfg.host == "https://api.example:6443" and cfg.verify_ssl is False
    assert (cfg.ssl_ca_cert, cfg.cert_file, cfg.key_file) == ("/ca.pem", "/me.crt", "/me.key")
    assert (cfg.proxy, cfg.no_proxy) == ("http://proxy:3128", "localhost,.cluster.local")
    assert cfg.proxy_headers == {"proxy-authorization": "Basic " + base64.b64encode(b"p:q").decode(),
                                 "user-agent": "x/1"}
    assert cfg.api_key == {"authorization": "Basic " + base64.b64encode(b"admin:s3cret").decode()}
    assert api.default_headers["Impersonate-User"] == "alice"
    # a bearer token wins over a user name and password, as a kubeconfig's token does over its basic auth
    token = k8s_api.api_client({"host": "https://api.example:6443", "api_key": "tok", "username": "u", "password": "p"})
    assert token.configuration.api_key == {"authorization": "Bearer tok"}


def test_a_kubeconfigs_refreshed_tokens_are_written_back_only_when_asked(no_k8s_environment, tmp_path):
    """kubernetes.core passes persist_config (unset: false) to the kubeconfig loader, whose own default is true."""
    calls = []

    class Loader(object):
        ConfigException = Exception

        @staticmethod
        def load_kube_config(**kwargs):
            calls.append(kwargs["persist_config"])

    for given, persisted in ((None, False), (True, True), (False, False)):
        options = k8s_api.connection_options({"kubeconfig": str(tmp_path / "kc"), "persist_config": given})
        k8s_api._load_config(Loader, None, options)
        assert calls.pop() is persisted
