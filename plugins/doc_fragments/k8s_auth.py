# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The connection to the Kubernetes API server, shared by the modules that reach it: kubernetes.core's connection
options (its k8s_auth_options), all of them, with the same names, aliases and K8S_AUTH_* environment variables."""
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
    description:
      - The API server's URL, instead of a kubeconfig (E(K8S_AUTH_HOST)). With it no kubeconfig is read; the
        credentials are O(api_key), or O(username) and O(password), or O(client_cert) and O(client_key).
    type: str
  api_key:
    description: A bearer token (E(K8S_AUTH_API_KEY)). It replaces a kubeconfig's credentials.
    type: str
  username:
    description:
      - A user name for HTTP basic authentication, with O(password) (E(K8S_AUTH_USERNAME)). Only API servers
        configured for basic authentication take it. It replaces a kubeconfig's credentials; O(api_key) wins over it.
    type: str
  password:
    description: The password of O(username) (E(K8S_AUTH_PASSWORD)).
    type: str
  validate_certs:
    description:
      - Whether to check the API server's certificate (E(K8S_AUTH_VALIDATE_CERTS), else E(K8S_AUTH_VERIFY_SSL); from
        the environment V(0), V(false) and V(no) in any case are false, anything else true).
    type: bool
    aliases: [verify_ssl]
  ca_cert:
    description:
      - The CA bundle to check the API server's certificate with, its full chain (E(K8S_AUTH_CA_CERT), else
        E(K8S_AUTH_SSL_CA_CERT)).
    type: path
    aliases: [ssl_ca_cert]
  client_cert:
    description: A client certificate for the API server (E(K8S_AUTH_CLIENT_CERT), else E(K8S_AUTH_CERT_FILE)).
    type: path
    aliases: [cert_file]
  client_key:
    description: The key of O(client_cert) (E(K8S_AUTH_CLIENT_KEY), else E(K8S_AUTH_KEY_FILE)).
    type: path
    aliases: [key_file]
  proxy:
    description:
      - The URL of an HTTP proxy to the API server (E(K8S_AUTH_PROXY)). The usual E(HTTP_PROXY) and E(HTTPS_PROXY)
        variables are not read.
    type: str
  no_proxy:
    description:
      - The hosts, domains, addresses or CIDR ranges that do not go through O(proxy), comma separated
        (E(K8S_AUTH_NO_PROXY)). The usual E(NO_PROXY) is not read.
    type: str
  proxy_headers:
    description:
      - The headers sent to O(proxy), made by urllib3's C(make_headers). Not given, each suboption is read from
        its own environment variable.
    type: dict
    suboptions:
      proxy_basic_auth:
        description: C(user:password) for the proxy's basic authentication (E(K8S_AUTH_PROXY_HEADERS_PROXY_BASIC_AUTH)).
        type: str
      basic_auth:
        description: C(user:password) for a basic authentication header (E(K8S_AUTH_PROXY_HEADERS_BASIC_AUTH)).
        type: str
      user_agent:
        description: The User-Agent header, for example C(foo/1.0) (E(K8S_AUTH_PROXY_HEADERS_USER_AGENT)).
        type: str
  persist_config:
    description:
      - Whether a kubeconfig's refreshed tokens (OIDC, a cloud's auth provider) are written back to its file
        (E(K8S_AUTH_PERSIST_CONFIG)). Not set, they are not.
    type: bool
  impersonate_user:
    description: The user to act as, through the API's impersonation (E(K8S_AUTH_IMPERSONATE_USER)).
    type: str
  impersonate_groups:
    description:
      - The groups to act as, through the API's impersonation; each is sent in its own header
        (E(K8S_AUTH_IMPERSONATE_GROUPS), comma separated).
    type: list
    elements: str
requirements:
  - The C(kubernetes) Python client where the task runs (the controller; the collection's execution environment has it).
"""
