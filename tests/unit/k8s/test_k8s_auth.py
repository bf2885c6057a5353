"""The connection options of the modules that reach the API server: named, typed and documented as
kubernetes.core's (its k8s_auth_options), each module with its own copy of the spec."""
from __future__ import annotations

import yaml

from ansible_collections.gpuckpt.fleet.plugins.doc_fragments.k8s_auth import ModuleDocFragment
from ansible_collections.gpuckpt.fleet.plugins.module_utils.k8s.api import AUTH_ARG_SPEC, AUTH_ENV, auth_args


def test_the_doc_fragment_documents_exactly_the_options_the_modules_take():
    documented = yaml.safe_load(ModuleDocFragment.DOCUMENTATION)["options"]
    assert sorted(documented) == sorted(AUTH_ARG_SPEC)
    for name, spec in AUTH_ARG_SPEC.items():
        assert documented[name]["type"] == spec["type"], name
        assert documented[name].get("aliases", []) == spec.get("aliases", []), name
        description = documented[name]["description"]
        assert AUTH_ENV[name] in " ".join(description if isinstance(description, list) else [description]), name


def test_the_names_are_kubernetes_cores():
    assert set(AUTH_ARG_SPEC) == {"kubeconfig", "context", "host", "api_key", "validate_certs", "ca_cert",
                                  "client_cert", "client_key"}
    assert AUTH_ENV["api_key"] == "K8S_AUTH_API_KEY" and AUTH_ARG_SPEC["api_key"]["no_log"] is True


def test_each_module_gets_its_own_copy_of_the_spec():
    """AnsibleModule may add to a spec it is given; one module's must never reach another's."""
    mine = auth_args()
    mine["validate_certs"]["aliases"].append("insecure")
    mine["host"]["required"] = True
    assert auth_args() == AUTH_ARG_SPEC and "insecure" not in AUTH_ARG_SPEC["validate_certs"]["aliases"]
