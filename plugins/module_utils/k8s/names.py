# -*- coding: utf-8 -*-
# Copyright: gpuckpt.fleet contributors
# GNU General Public License v3.0+ (see https://www.gnu.org/licenses/gpl-3.0.txt)
"""The names by which a node's containerd knows a Kubernetes pod's containers: one place for every room.

The kubelet's CRI keeps its containers in containerd's ``k8s.io`` namespace and labels each with its pod's
namespace, name and uid, its container's name and its kind (``sandbox`` for the pause container).
"""
from __future__ import annotations

K8S_NAMESPACE = "k8s.io"  # the containerd namespace of the kubelet's CRI: pods' containers
POD_NAMESPACE, POD_NAME, POD_UID = "io.kubernetes.pod.namespace", "io.kubernetes.pod.name", "io.kubernetes.pod.uid"
CONTAINER_NAME, KIND = "io.kubernetes.container.name", "io.cri-containerd.kind"
KUBELET_LABELS = (POD_NAMESPACE, POD_NAME, POD_UID, CONTAINER_NAME, KIND)
