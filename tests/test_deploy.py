"""deploy/kubernetes/: the manifests parse, and agree with each other and with the topology
they carry. Nothing here runs a cluster; the point is that a renamed Service, a moved port or
a replica added in one place only fails here rather than in a pod's logs."""

import os
import re
import subprocess

import pytest
import yaml

from serving.runtime.topology import load_topology

from .conftest import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
API_VERSIONS = {"ConfigMap": "v1", "Service": "v1", "StatefulSet": "apps/v1", "Deployment": "apps/v1"}
WORKLOAD_OF_SERVICE = {"tercet-replica": ("StatefulSet", "tercet-replica"),
                       "tercet-frontend": ("Deployment", "tercet-frontend")}


def manifest_files():
    return sorted(p for p in DEPLOY.glob("*.yaml") if p.name != "kustomization.yaml")


@pytest.fixture(scope="module")
def objects():
    """Every object of every manifest, by (kind, name)."""
    found = {}
    for path in manifest_files():
        for doc in yaml.safe_load_all(path.read_text()):
            key = (doc["kind"], doc["metadata"]["name"])
            assert key not in found, f"{path.name}: {key} defined twice"
            found[key] = doc
    return found


@pytest.fixture(scope="module")
def topology(objects):
    """The topology YAML inside the ConfigMap, as data."""
    return yaml.safe_load(objects["ConfigMap", "tercet-topology"]["data"]["topology.yaml"])


def port_of(address):
    return int(address.rpartition(":")[2])


def host_of(address):
    return address.removeprefix("tcp://").rpartition(":")[0]


def container(workload):
    (only,) = workload["spec"]["template"]["spec"]["containers"]
    return only


def container_ports(workload):
    return {p["name"]: p["containerPort"] for p in container(workload)["ports"]}


def readme_names():
    """The Secret and key names the README tells the operator to create."""
    text = (DEPLOY / "README.md").read_text()
    secret = re.search(r"kubectl create secret generic (\S+) --from-file=keys/", text)
    keys = re.search(r"zmq\.auth\.create_certificates\('keys', '(\w+)'\)", text)
    assert secret and keys, "README.md no longer says how to make the keys and the Secret"
    return secret[1], keys[1]


def test_every_object_has_a_known_kind_and_api_version(objects):
    assert {kind for kind, _ in objects} == set(API_VERSIONS)
    for (kind, name), doc in objects.items():
        assert doc["apiVersion"] == API_VERSIONS[kind], (kind, name)


def test_kustomization_lists_every_manifest():
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    assert kustomization["apiVersion"] == "kustomize.config.k8s.io/v1beta1"
    assert kustomization["kind"] == "Kustomization"
    assert sorted(kustomization["resources"]) == [p.name for p in manifest_files()]


@pytest.mark.parametrize("service", sorted(WORKLOAD_OF_SERVICE))
def test_each_service_selects_its_own_pods_only(objects, service):
    selector = objects["Service", service]["spec"]["selector"].items()
    selected = set()
    for key in (k for k in objects if k[0] in ("StatefulSet", "Deployment")):
        spec = objects[key]["spec"]
        labels = spec["template"]["metadata"]["labels"].items()
        assert spec["selector"]["matchLabels"].items() <= labels, key  # else the API server refuses it
        if selector <= labels:
            selected.add(key)
    assert selected == {WORKLOAD_OF_SERVICE[service]}


def test_statefulset_is_governed_by_the_headless_service(objects):
    sts = objects["StatefulSet", "tercet-replica"]
    service = objects["Service", sts["spec"]["serviceName"]]
    assert service["spec"]["clusterIP"] == "None"  # the per-pod DNS names exist only then
    # a replica dials its own detokenizer, and the front end its replicas, before they are ready
    assert service["spec"]["publishNotReadyAddresses"] is True


def test_replica_counts_agree(objects, topology):
    assert objects["StatefulSet", "tercet-replica"]["spec"]["replicas"] == topology["scheduler"]["replicas"] \
        == len(topology["actors"]["replicas"])


def test_replica_addresses_are_the_pod_dns_names(objects, topology):
    sts = objects["StatefulSet", "tercet-replica"]
    for i, replica in enumerate(topology["actors"]["replicas"]):
        for actor in ("scheduler", "detokenizer"):
            placement = replica[actor]
            assert placement["process"] == "remote"  # the pods start them, not the front end
            assert host_of(placement["address"]) == f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}"
            assert placement["bind"] == f"tcp://0.0.0.0:{port_of(placement['address'])}"


def test_replica_ports_agree(objects, topology):
    sts = objects["StatefulSet", "tercet-replica"]
    service_ports = {p["name"]: p for p in objects["Service", "tercet-replica"]["spec"]["ports"]}
    probes = container(sts)
    for replica in topology["actors"]["replicas"]:
        for actor in ("scheduler", "detokenizer"):
            wanted = port_of(replica[actor]["address"])
            # headless: DNS gives the pod's IP, so the dialed port is the pod's own
            assert service_ports[actor]["port"] == service_ports[actor]["targetPort"] == wanted
            assert container_ports(sts)[actor] == port_of(replica[actor]["bind"]) == wanted
        for probe in ("readinessProbe", "livenessProbe"):
            assert probes[probe]["tcpSocket"]["port"] == port_of(replica["scheduler"]["bind"])


def test_frontend_ports_agree(objects, topology):
    deployment = objects["Deployment", "tercet-frontend"]
    service = objects["Service", "tercet-frontend"]
    service_ports = {p["name"]: p for p in service["spec"]["ports"]}
    mailbox = topology["actors"]["tokenizer"]
    # the replicas' detokenizers dial the mailbox through this Service
    assert host_of(mailbox["address"]) == service["metadata"]["name"]
    assert service_ports["mailbox"]["port"] == port_of(mailbox["address"])
    assert service_ports["mailbox"]["targetPort"] == container_ports(deployment)["mailbox"] \
        == port_of(mailbox["bind"])
    server = topology["server"]
    assert server["host"] == "0.0.0.0" and server["workers"] == 1
    assert service_ports["http"]["targetPort"] == container_ports(deployment)["http"] == server["port"]
    for probe in ("readinessProbe", "livenessProbe"):
        assert container(deployment)[probe]["httpGet"] == {"path": "/health", "port": server["port"]}


@pytest.mark.parametrize("workload", [("StatefulSet", "tercet-replica"), ("Deployment", "tercet-frontend")])
def test_config_and_keys_are_mounted_where_the_topology_says(objects, topology, workload):
    spec = objects[workload]["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in spec["volumes"]}
    mounts = {m["mountPath"]: m for m in container(objects[workload])["volumeMounts"]}
    secret_name, key_name = readme_names()

    # the --config file is the ConfigMap's key, mounted there
    config = mounts[re.search(r"--config (\S+)", " ".join(container(objects[workload])["command"]))[1]]
    config_map = objects["ConfigMap", volumes[config["name"]]["configMap"]["name"]]
    assert config["subPath"] in config_map["data"]

    # the curve files are those create_certificates wrote, in the Secret the README creates
    (keys,) = [m for m in mounts.values() if "secret" in volumes[m["name"]]]
    assert volumes[keys["name"]]["secret"]["secretName"] == secret_name
    curve = topology["transport"]["curve"]
    directory = keys["mountPath"].rstrip("/")
    assert curve["secret_file"] == f"{directory}/{key_name}.key_secret"
    assert curve["server_public_file"] == f"{directory}/{key_name}.key"
    assert curve["authorized_dir"].rstrip("/") == directory


def test_replica_index_comes_from_the_pod_name(objects, tmp_path):
    """Run the container's command with a fake ``tercet`` that prints its arguments."""
    sts = objects["StatefulSet", "tercet-replica"]
    fake = tmp_path / "tercet"
    fake.write_text('#!/bin/sh\necho "$@"\n')
    fake.chmod(0o755)
    for i in range(sts["spec"]["replicas"]):
        env = {**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}", "HOSTNAME": f"{sts['metadata']['name']}-{i}"}
        out = subprocess.run(container(sts)["command"], env=env, capture_output=True, text=True, check=True).stdout
        assert out.split() == ["replica", "--config", "/etc/tercet/topology.yaml", "--index", str(i)]


def test_topology_loads(topology, tmp_path):
    # the key files exist only in a pod (the Secret), and load_topology reads them: check the
    # rest of the topology with curve swapped for allow_insecure (the curve paths are checked
    # against the Secret's mount above)
    data = {**topology, "transport": {**topology["transport"], "allow_insecure": True}}
    del data["transport"]["curve"]
    path = tmp_path / "topology.yaml"
    path.write_text(yaml.safe_dump(data))
    loaded = load_topology(path)
    assert loaded.replicated
    assert loaded.replica_addresses(tmp_path) == [
        {"scheduler": r["scheduler"]["address"], "detokenizer": r["detokenizer"]["address"]}
        for r in topology["actors"]["replicas"]]
