"""deploy/kubernetes/: the manifests parse, and agree with each other and with the topology
they carry. Nothing here runs a cluster; the point is that a renamed Service, a moved port or
a replica added in one place only fails here rather than in a pod's logs. Then what a cluster
admin checks: the API's schemas (kubernetes-validate --strict), a policy scanner (checkov,
offline), and the security settings, network policies and key handling one by one."""

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from serving.runtime.topology import load_topology

from .conftest import ROOT

DEPLOY = ROOT / "deploy" / "kubernetes"
API_VERSIONS = {"ConfigMap": "v1", "Service": "v1", "StatefulSet": "apps/v1", "Deployment": "apps/v1",
                "Namespace": "v1", "NetworkPolicy": "networking.k8s.io/v1"}
WORKLOADS = [("StatefulSet", "tercet-replica"), ("Deployment", "tercet-frontend")]
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
    secret = re.search(r"kubectl (?:-n \S+ )?create secret generic (\S+) --from-file=keys/", text)
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
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
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
    # ...and answer the front end's heartbeats at the monitor, through it too
    monitor = topology["actors"]["monitor"]
    assert host_of(monitor["address"]) == service["metadata"]["name"]
    assert service_ports["monitor"]["port"] == port_of(monitor["address"])
    assert service_ports["monitor"]["targetPort"] == container_ports(deployment)["monitor"] \
        == port_of(monitor["bind"])
    server = topology["server"]
    assert server["host"] == "0.0.0.0" and server["workers"] == 1
    assert service_ports["http"]["targetPort"] == container_ports(deployment)["http"] == server["port"]
    # ready while a replica serves; alive (not restarted) while its own loop answers, whatever the replicas
    assert container(deployment)["readinessProbe"]["httpGet"] == {"path": "/health", "port": server["port"]}
    for probe in ("livenessProbe", "startupProbe"):
        assert container(deployment)[probe]["httpGet"] == {"path": "/livez", "port": server["port"]}


@pytest.mark.parametrize("workload", WORKLOADS)
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
    (keys,) = [m for m in mounts.values() if volumes[m["name"]].get("secret", {}).get("secretName") == secret_name]
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


# -- what a cluster admin checks (N9, N17) ------------------------------------------------


def pod_spec(objects, workload):
    return objects[workload]["spec"]["template"]["spec"]


def test_every_object_is_in_the_restricted_namespace(objects):
    (namespace,) = [name for kind, name in objects if kind == "Namespace"]
    labels = objects["Namespace", namespace]["metadata"]["labels"]
    assert labels["pod-security.kubernetes.io/enforce"] == "restricted"
    for (kind, name), doc in objects.items():
        if kind != "Namespace":
            assert doc["metadata"]["namespace"] == namespace, (kind, name)
    assert yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())["namespace"] == namespace


@pytest.mark.parametrize("workload", WORKLOADS)
def test_pods_run_unprivileged_on_a_read_only_root(objects, workload):
    spec = pod_spec(objects, workload)
    assert spec["automountServiceAccountToken"] is False
    pod = spec["securityContext"]
    assert pod["runAsNonRoot"] is True and pod["runAsUser"] >= 10000
    assert pod["seccompProfile"] == {"type": "RuntimeDefault"}
    c = container(objects[workload])["securityContext"]
    assert c["runAsNonRoot"] is True and c["allowPrivilegeEscalation"] is False and c["privileged"] is False
    assert c["readOnlyRootFilesystem"] is True and c["capabilities"] == {"drop": ["ALL"]}
    assert c["seccompProfile"] == {"type": "RuntimeDefault"}
    # every Secret readable by the pod's group only (root owns the files; fsGroup is the pod's)
    for volume in spec["volumes"]:
        if "secret" in volume:
            assert volume["secret"]["defaultMode"] == 0o440 and pod["fsGroup"] == pod["runAsGroup"], volume


@pytest.mark.parametrize("workload", WORKLOADS)
def test_what_is_written_goes_to_sized_empty_dirs(objects, workload):
    spec = pod_spec(objects, workload)
    volumes = {v["name"]: v for v in spec["volumes"]}
    the_container = container(objects[workload])
    writable = [m["mountPath"] for m in the_container["volumeMounts"] if "emptyDir" in volumes[m["name"]]]
    for name, volume in volumes.items():
        if "emptyDir" in volume:
            assert re.fullmatch(r"\d+[MG]i", volume["emptyDir"]["sizeLimit"]), name
    env = {e["name"]: e["value"] for e in the_container["env"]}
    for path in ("/tmp", env["TERCET_CACHE_DIR"], env["HOME"]):  # tercet's cache, the runtime dir, ~/.cache
        assert any(path == w or path.startswith(w + "/") for w in writable), path
    # the cache dir itself is made by tercet (0700) inside the volume: an emptyDir's root is 0777
    assert env["TERCET_CACHE_DIR"] not in writable


@pytest.mark.parametrize("workload", WORKLOADS)
def test_the_image_is_a_fixed_tag(objects, workload):
    image = container(objects[workload])["image"]
    name, _, tag = image.rpartition(":")
    assert name and tag and tag != "latest" and "/" not in tag, image
    assert {container(objects[w])["image"] for w in WORKLOADS} == {image}  # one build for both


def test_the_api_keys_come_from_a_secret_file_never_the_command_line(objects, topology):
    """The front end reads its keys from Secret files (``--api-key-file``), so no key is in the
    ConfigMap, on a command line (/proc/PID/cmdline) or in an env var a `kubectl describe` shows."""
    deployment = objects["Deployment", "tercet-frontend"]
    command = container(deployment)["command"]
    assert "--api-key" not in command and "--admin-api-key" not in command
    assert "api_key" not in topology["server"] and "admin_api_key" not in topology["server"]
    volumes = {v["name"]: v for v in pod_spec(objects, ("Deployment", "tercet-frontend"))["volumes"]}
    mounts = {m["mountPath"]: m for m in container(deployment)["volumeMounts"]}
    text = (DEPLOY / "README.md").read_text()
    for flag, key in (("--api-key-file", "api_key"), ("--admin-api-key-file", "admin_api_key")):
        path = command[command.index(flag) + 1]
        directory, _, file = path.rpartition("/")
        assert file == key and mounts[directory]["readOnly"] is True
        secret = volumes[mounts[directory]["name"]]["secret"]["secretName"]
        assert re.search(rf"create secret generic {secret} .*--from-file={key}\b", text), (secret, key)
    assert not any("KEY" in e["name"] for e in container(deployment)["env"])


def test_the_liveness_route_is_served_without_a_key():
    from serving.http.app import ROUTES, UNPROTECTED

    assert "/livez" in UNPROTECTED and ("/livez", ["GET"]) in [(path, methods) for path, _, methods in ROUTES]


def selected_by(policy, labels):
    return policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()


def allowed_ports(policy, direction):
    return {p["port"] for rule in policy["spec"].get(direction, []) for p in rule.get("ports", [])}


@pytest.mark.parametrize("workload", WORKLOADS)
def test_every_pod_has_a_network_policy_opening_its_own_ports_only(objects, workload):
    labels = objects[workload]["spec"]["template"]["metadata"]["labels"]
    policies = [doc for (kind, _), doc in objects.items() if kind == "NetworkPolicy" and selected_by(doc, labels)]
    (policy,) = policies
    assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]  # what is not listed is refused
    assert allowed_ports(policy, "ingress") == set(container_ports(objects[workload]).values())


def test_only_tercet_pods_reach_the_actors(objects):
    """The replicas' ports and the front end's mailbox admit tercet's pods only; the front end's
    HTTP port is the one open to the cluster."""
    pods = {w: objects[w]["spec"]["template"]["metadata"]["labels"] for w in WORKLOADS}
    policies = [doc for (kind, _), doc in objects.items() if kind == "NetworkPolicy"]
    http = objects["ConfigMap", "tercet-topology"]["data"]["topology.yaml"]
    http_port = yaml.safe_load(http)["server"]["port"]
    for policy in policies:
        for rule in policy["spec"]["ingress"]:
            ports = {p["port"] for p in rule["ports"]}
            if ports == {http_port}:
                continue
            assert rule["from"], policy["metadata"]["name"]
            for peer in rule["from"]:
                assert set(peer) == {"podSelector"}  # no namespaceSelector, no ipBlock
                assert any(peer["podSelector"]["matchLabels"].items() <= labels.items() for labels in pods.values())


def test_the_replicas_may_dial_the_front_ends_mailbox_and_monitor_only(objects, topology):
    frontend = objects["Deployment", "tercet-frontend"]["spec"]["template"]["metadata"]["labels"]
    egress = objects["NetworkPolicy", "tercet-replica"]["spec"]["egress"]
    dialed = {p["port"] for rule in egress for peer in rule["to"]
              if peer.get("podSelector", {}).get("matchLabels", {}).items() <= frontend.items() and "namespaceSelector" not in peer
              for p in rule["ports"]}
    assert dialed == {port_of(topology["actors"][actor]["address"]) for actor in ("tokenizer", "monitor")}


def test_manifests_pass_the_kubernetes_schemas_strictly():
    """Every field known to the API (1.37), no typo'd one silently dropped (``--strict``)."""
    done = subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet",
                           *map(str, manifest_files())], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def checkov():
    """checkov, beside this Python (its pins, packaging<24 among them, refuse pytest 9 and ray: it is
    the ``deploy-check`` extra, installed on its own: .ci/setup puts it in .venv-checkov)."""
    places = [Path(sys.executable).parent, Path(__file__).resolve().parents[1] / ".venv-checkov" / "bin"]  # .ci/setup's
    found = shutil.which("checkov", path=os.pathsep.join([*map(str, places), os.environ["PATH"]]))
    if found is None:
        pytest.skip("checkov is not installed (pip install 'tercet[deploy-check]')")
    return found


def test_checkov_fails_only_the_image_digest_check(tmp_path):
    """The policy scanner, offline (``BC_SKIP_MAPPING=TRUE``, ``--skip-download``). The one check
    left, an image pinned by digest, is explained in README.md: the digest exists once you push."""
    env = {**os.environ, "BC_SKIP_MAPPING": "TRUE", "HOME": str(tmp_path)}
    done = subprocess.run([checkov(), "--framework", "kubernetes", "--skip-download", "--quiet", "-o", "json",
                           "-d", str(DEPLOY)], capture_output=True, text=True, timeout=300, env=env)
    report = json.loads(done.stdout)
    failed = {(c["check_id"], c["resource"]) for c in report["results"]["failed_checks"]}
    assert {check for check, _ in failed} == {"CKV_K8S_43"}, sorted(failed)
    assert report["summary"]["parsing_errors"] == 0 and report["summary"]["passed"] >= 170
    assert "CKV_K8S_43" in (DEPLOY / "README.md").read_text()
