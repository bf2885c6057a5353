# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The connection to the Kubernetes API server, on the controller, through the ``kubernetes`` Python client (what
kubernetes.core's modules use): its options, named and read from the environment as kubernetes.core's
(AUTH_ARG_SPEC, K8S_AUTH_*), the client they make, and the reads of a pod or a node with the API's refusals
turned into errors that say what was asked.

The client is imported only when the API is reached: the rest of the engine imports without it.
"""
from __future__ import annotations

import copy
import os

from ..core.errors import GpuCkptError, InvalidTarget

# The connection options, shared by every module that reaches the API server: kubernetes.core's AUTH_ARG_SPEC and
# AUTH_PROXY_HEADERS_SPEC (plugins/module_utils/args_common.py), all of them, with its names, types, aliases and
# no_log (tests/unit/k8s/test_k8s_auth.py compares them with the real ones).
AUTH_PROXY_HEADERS_SPEC = dict(
    proxy_basic_auth=dict(type="str", no_log=True),
    basic_auth=dict(type="str", no_log=True),
    user_agent=dict(type="str"),
)
AUTH_ARG_SPEC = dict(
    kubeconfig=dict(type="raw", no_log=True),
    context=dict(type="str"),
    host=dict(type="str"),
    api_key=dict(type="str", no_log=True),
    username=dict(type="str"),
    password=dict(type="str", no_log=True),
    validate_certs=dict(type="bool", aliases=["verify_ssl"]),
    ca_cert=dict(type="path", aliases=["ssl_ca_cert"]),
    client_cert=dict(type="path", aliases=["cert_file"]),
    client_key=dict(type="path", aliases=["key_file"]),
    proxy=dict(type="str"),
    no_proxy=dict(type="str"),
    proxy_headers=dict(type="dict", options=AUTH_PROXY_HEADERS_SPEC),
    persist_config=dict(type="bool"),
    impersonate_user=dict(type="str"),
    impersonate_groups=dict(type="list", elements="str"),
)
# The environment variables an option not given is read from, in kubernetes.core's order: K8S_AUTH_<option>, then
# K8S_AUTH_<alias> (the alias is the kubernetes client's own name: verify_ssl, ssl_ca_cert, cert_file, key_file).
AUTH_ENV = {name: tuple("K8S_AUTH_" + n.upper() for n in [name] + spec.get("aliases", []))
            for name, spec in AUTH_ARG_SPEC.items() if name != "proxy_headers"}
# proxy_headers not given is made of K8S_AUTH_PROXY_HEADERS_<suboption>, each read on its own.
AUTH_PROXY_HEADERS_ENV = {name: "K8S_AUTH_PROXY_HEADERS_" + name.upper() for name in AUTH_PROXY_HEADERS_SPEC}
# The headers of the API's user impersonation (kubectl --as, --as-group).
IMPERSONATION_HEADERS = {"impersonate_user": "Impersonate-User", "impersonate_groups": "Impersonate-Group"}


class KubernetesError(GpuCkptError):
    """The API server could not be reached or refused a request; nothing on the nodes was touched."""


def auth_args():
    """A fresh copy of the connection options for a module's argument_spec (each module may change its own)."""
    return copy.deepcopy(AUTH_ARG_SPEC)


def _from_environment(spec, value):
    """An environment variable's text as the option's type, as kubernetes.core reads it: a bool is false for
    0, false or no (any case) and true for anything else; a list is split on commas."""
    if spec.get("type") == "bool":
        return value.lower() not in ("0", "false", "no")
    if spec.get("type") == "list":
        return [item for item in value.split(",") if item != ""]
    return value


def connection_options(params):
    """Every connection option, from the module's parameters, else from the environment (see AUTH_ENV); None
    where neither gives it."""
    options = {}
    for name, spec in AUTH_ARG_SPEC.items():
        value = params.get(name)
        if value is None and name == "proxy_headers":
            value = {key: os.environ[env] for key, env in AUTH_PROXY_HEADERS_ENV.items() if env in os.environ} or None
        elif value is None:
            value = next((_from_environment(spec, os.environ[env]) for env in AUTH_ENV[name] if os.environ.get(env)),
                         None)
        options[name] = value
    return options


def _load_config(config, cfg, p):
    """``cfg`` filled from a kubeconfig (``kubeconfig``, a path or a dict, and ``context``; ~/.kube/config by
    default), else, inside a cluster with neither given, from the pod's own service account. The kubeconfig's
    refreshed tokens are written back to it only with ``persist_config`` (false by default, as kubernetes.core)."""
    if p["kubeconfig"] or p["context"] or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        persist = bool(p["persist_config"])
        if isinstance(p["kubeconfig"], dict):
            config.load_kube_config_from_dict(p["kubeconfig"], context=p["context"], client_configuration=cfg,
                                              persist_config=persist)
        else:
            path = os.path.expanduser(p["kubeconfig"]) if p["kubeconfig"] else None
            config.load_kube_config(config_file=path, context=p["context"], client_configuration=cfg,
                                    persist_config=persist)
    else:
        config.load_incluster_config(client_configuration=cfg)


def _credentials(p):
    """The Authorization header the options give: ``api_key`` as a bearer token, else ``username`` and
    ``password`` as HTTP basic auth (what the kubernetes client's own kubeconfig loader makes of them); None when
    they give none (the kubeconfig's, or none at all, stay)."""
    from urllib3.util import make_headers
    if p["api_key"]:
        return "Bearer " + p["api_key"]
    if p["username"] and p["password"]:
        return make_headers(basic_auth="%s:%s" % (p["username"], p["password"]))["authorization"]
    return None


class _RepeatedHeader(str):
    """A header name that is a key of its own in a dict: the ApiClient's default headers are a dict, and the
    API server takes each impersonated group from its own Impersonate-Group header (kubernetes.core does the same)."""

    def __hash__(self):
        return id(self)

    def __eq__(self, other):
        return self is other

    def __ne__(self, other):
        return self is not other


def _impersonate(api, p):
    """The impersonation headers on every request of ``api``: one Impersonate-User, one Impersonate-Group per group."""
    if p["impersonate_user"]:
        api.set_default_header(IMPERSONATION_HEADERS["impersonate_user"], p["impersonate_user"])
    for group in p["impersonate_groups"] or []:
        api.set_default_header(_RepeatedHeader(IMPERSONATION_HEADERS["impersonate_groups"]), group)


def _configure(cfg, p):
    """The options that hold whichever way the connection was found: credentials, TLS and the proxy, each set on
    the client's Configuration under its own name there."""
    from urllib3.util import make_headers
    authorization = _credentials(p)
    if authorization:
        cfg.api_key = {"authorization": authorization}
    if p["username"] is not None:
        cfg.username = p["username"]
    if p["password"] is not None:
        cfg.password = p["password"]
    if p["validate_certs"] is not None:
        cfg.verify_ssl = bool(p["validate_certs"])
    for option, attr in (("ca_cert", "ssl_ca_cert"), ("client_cert", "cert_file"), ("client_key", "key_file"),
                         ("proxy", "proxy"), ("no_proxy", "no_proxy")):
        if p[option]:
            setattr(cfg, attr, p[option])
    if p["proxy_headers"]:
        cfg.proxy_headers = make_headers(**{k: v for k, v in p["proxy_headers"].items() if v is not None})


def api_client(params):
    """A kubernetes ApiClient from the connection options (connection_options): ``host`` (with ``api_key``, or
    ``username`` and ``password``, or the TLS files), else a kubeconfig (``kubeconfig``, a path or a dict, and
    ``context``; ~/.kube/config by default), else the pod's own service account when running in a cluster; then
    the credentials, TLS, proxy and impersonation options given over whatever the kubeconfig said."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise KubernetesError("the kubernetes Python client is not installed where this task runs (%s)" % exc,
                              stage="preflight", hint="pip install kubernetes (the collection's EE has it)")
    p = connection_options(params)
    cfg = client.Configuration()
    try:
        if p["host"]:
            cfg.host = p["host"].rstrip("/")
        else:
            _load_config(config, cfg, p)
        _configure(cfg, p)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise KubernetesError("no usable connection to the Kubernetes API: %s" % exc, stage="preflight",
                              hint="set kubeconfig (and context), or host and api_key")
    api = client.ApiClient(cfg)
    _impersonate(api, p)
    return api


def api_error(exc, what):
    """A refusal of the API (an ApiException) as the error this collection reports."""
    status = getattr(exc, "status", None)
    reason = getattr(exc, "reason", None) or exc.__class__.__name__
    return KubernetesError("the Kubernetes API refused %s: %s %s" % (what, status or "", reason), stage="preflight",
                           details={"api_status": status})


def core_api(api):
    from kubernetes import client
    return client.CoreV1Api(api)


def _read(api, read, what, missing):
    """``read()`` (a CoreV1Api read) as a dict in the API's own field names; ``missing`` (an InvalidTarget) when
    there is no such object, KubernetesError when the API refuses or cannot be reached."""
    from kubernetes.client.exceptions import ApiException
    from urllib3.exceptions import HTTPError
    try:
        return api.sanitize_for_serialization(read())
    except ApiException as exc:
        if exc.status == 404:
            raise missing
        raise api_error(exc, "reading %s" % what)
    except HTTPError as exc:
        raise KubernetesError("the Kubernetes API at %s could not be reached: %s; nothing was frozen"
                              % (api.configuration.host, exc), stage="preflight")


def read_pod(api, namespace, name):
    """The pod as the API returns it (a dict in the API's own field names), or InvalidTarget."""
    missing = InvalidTarget("there is no pod %s in namespace %s; nothing was frozen" % (name, namespace),
                            stage="preflight", hint="kubectl get pods -n %s" % namespace)
    return _read(api, lambda: core_api(api).read_namespaced_pod(name, namespace), "pod %s/%s" % (namespace, name),
                 missing)


def find_pod(api, namespace, name):
    """The pod as the API returns it, or None when there is none of that name."""
    try:
        return read_pod(api, namespace, name)
    except InvalidTarget:
        return None


def read_node(api, node):
    """The node as the API returns it, or InvalidTarget."""
    missing = InvalidTarget("there is no node %s in the cluster; nothing was frozen" % node, stage="preflight",
                            hint="kubectl get nodes")
    return _read(api, lambda: core_api(api).read_node(node), "node %s" % node, missing)
