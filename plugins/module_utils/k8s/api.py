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

# The connection options, shared by every module that reaches the API server (kubernetes.core's
# AUTH_ARG_SPEC, and its K8S_AUTH_* environment variables, are the model).
AUTH_ARG_SPEC = dict(
    kubeconfig=dict(type="raw", no_log=False),
    context=dict(type="str"),
    host=dict(type="str"),
    api_key=dict(type="str", no_log=True),
    validate_certs=dict(type="bool", aliases=["verify_ssl"]),
    ca_cert=dict(type="path", aliases=["ssl_ca_cert"]),
    client_cert=dict(type="path", aliases=["cert_file"]),
    client_key=dict(type="path", aliases=["key_file"]),
)
AUTH_ENV = {name: "K8S_AUTH_" + name.upper() for name in AUTH_ARG_SPEC}


class KubernetesError(GpuCkptError):
    """The API server could not be reached or refused a request; nothing on the nodes was touched."""


def auth_args():
    """A fresh copy of the connection options for a module's argument_spec (each module may change its own)."""
    return copy.deepcopy(AUTH_ARG_SPEC)


def _auth_value(params, name):
    value = params.get(name)
    if value is None:
        value = os.environ.get(AUTH_ENV[name])
        if name == "validate_certs" and value is not None:
            value = value.strip().lower() not in ("0", "false", "no", "off")
    return value


def _load_config(config, cfg, p):
    """``cfg`` filled from a kubeconfig (``kubeconfig``, a path or a dict, and ``context``; ~/.kube/config by
    default), else, inside a cluster with neither given, from the pod's own service account."""
    if p["kubeconfig"] or p["context"] or not os.environ.get("KUBERNETES_SERVICE_HOST"):
        if isinstance(p["kubeconfig"], dict):
            config.load_kube_config_from_dict(p["kubeconfig"], context=p["context"], client_configuration=cfg)
        else:
            path = os.path.expanduser(p["kubeconfig"]) if p["kubeconfig"] else None
            config.load_kube_config(config_file=path, context=p["context"], client_configuration=cfg)
    else:
        config.load_incluster_config(client_configuration=cfg)


def api_client(params):
    """A kubernetes ApiClient from the connection options: ``host`` (with ``api_key`` and the TLS
    files), else a kubeconfig (``kubeconfig``, a path or a dict, and ``context``; ~/.kube/config by
    default), else the pod's own service account when running in a cluster."""
    try:
        from kubernetes import client, config
    except ImportError as exc:
        raise KubernetesError("the kubernetes Python client is not installed where this task runs (%s)" % exc,
                              stage="preflight", hint="pip install kubernetes (the collection's EE has it)")
    p = {name: _auth_value(params, name) for name in AUTH_ARG_SPEC}
    cfg = client.Configuration()
    try:
        if p["host"]:
            cfg.host = p["host"]
            if p["api_key"]:
                cfg.api_key = {"authorization": "Bearer " + p["api_key"]}
        else:
            _load_config(config, cfg, p)
    except (config.ConfigException, OSError, TypeError, ValueError) as exc:
        raise KubernetesError("no usable connection to the Kubernetes API: %s" % exc, stage="preflight",
                              hint="set kubeconfig (and context), or host and api_key")
    if p["validate_certs"] is not None:
        cfg.verify_ssl = bool(p["validate_certs"])
    for option, attr in (("ca_cert", "ssl_ca_cert"), ("client_cert", "cert_file"), ("client_key", "key_file")):
        if p[option]:
            setattr(cfg, attr, p[option])
    return client.ApiClient(cfg)


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
