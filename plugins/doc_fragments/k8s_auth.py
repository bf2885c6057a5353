# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The connection to the Kubernetes API server, shared by the modules that reach it (kubernetes.core's
k8s_auth_options is the model: the same names and K8S_AUTH_* environment variables)."""
from __future__ import annotations


class ModuleDocFragment(object):
    # The modules that talk to the API server from the controller: any platform, no diff. Each gives its check mode.
    DOCUMENTATION = r"""
attributes:
  diff_mode:
    support: none
  platform:
    platforms: all
options:
  kubeconfig:
    description:
      - A kubeconfig file's path, or its content as a dict. By default C(~/.kube/config), or the pod's service account
        when this runs inside a cluster. Also read from E(K8S_AUTH_KUBECONFIG).
    type: raw
  context:
    description: The kubeconfig context (E(K8S_AUTH_CONTEXT)).
    type: str
  host:
    description: The API server's URL, instead of a kubeconfig (E(K8S_AUTH_HOST)).
    type: str
  api_key:
    description: A bearer token for O(host) (E(K8S_AUTH_API_KEY)).
    type: str
  validate_certs:
    description: Whether to check the API server's certificate (E(K8S_AUTH_VALIDATE_CERTS)).
    type: bool
    aliases: [verify_ssl]
  ca_cert:
    description: The CA bundle to check the API server's certificate with (E(K8S_AUTH_CA_CERT)).
    type: path
    aliases: [ssl_ca_cert]
  client_cert:
    description: A client certificate for the API server (E(K8S_AUTH_CLIENT_CERT)).
    type: path
    aliases: [cert_file]
  client_key:
    description: The key of O(client_cert) (E(K8S_AUTH_CLIENT_KEY)).
    type: path
    aliases: [key_file]
requirements:
  - The C(kubernetes) Python client where the task runs (the controller; the collection's execution environment has it).
"""
