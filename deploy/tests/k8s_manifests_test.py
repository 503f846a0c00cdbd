"""Parses every Kubernetes manifest under deploy/k8s and checks the fields that matter:
kinds, labels and selectors, the refitd config each pod gets (ConfigMap + command-line
overrides), the socket path against the volume mounts, probes against --health-listen,
container ports against the config, hostIPC, the native sidecars, Prometheus annotations.
"""

import os
import posixpath
import re
import sys
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import deploytest as dt  # noqa: E402

KNOWN_KINDS = {"Namespace", "ConfigMap", "Service", "DaemonSet", "Pod", "Kustomization",
               "Issuer", "Certificate"}
NAMESPACED = {"ConfigMap", "Service", "DaemonSet", "Pod", "Issuer", "Certificate"}
POD_IP = "<fieldRef:status.podIP>"
POD_NAME = "<fieldRef:metadata.name>"
CSI_DRIVER = "csi.cert-manager.io"


def host_port(value):
    """"HOST:PORT" -> (HOST, PORT), HOST possibly a <fieldRef:...> marker."""
    host, _, port = value.rpartition(":")
    return host, int(port)


def load_all():
    """{relpath: [documents]} for every YAML file under deploy/k8s."""
    return {f: dt.load_yaml_documents(f) for f in dt.k8s_manifest_files()}


def objects(manifests, kind=None, under=None):
    out = []
    for f, docs in manifests.items():
        if under and not f.startswith(under):
            continue
        for d in docs:
            if kind is None or d.get("kind") == kind:
                out.append(d)
    return out


def selects(selector, labels):
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def pod_spec(obj):
    return obj["spec"]["template"]["spec"] if obj["kind"] == "DaemonSet" else obj["spec"]


def pod_labels(obj):
    meta = obj["spec"]["template"]["metadata"] if obj["kind"] == "DaemonSet" else obj["metadata"]
    return meta.get("labels", {})


def pod_annotations(obj):
    meta = obj["spec"]["template"]["metadata"] if obj["kind"] == "DaemonSet" else obj["metadata"]
    return meta.get("annotations", {})


def is_refitd(container):
    return container.get("image", "").startswith("refit/refitd:") and (
        container.get("command", [""])[0].endswith("/refitd"))


def refitd_containers(spec):
    """[(container, is_init)] for the containers of a pod spec that run refitd."""
    out = [(c, False) for c in spec.get("containers", []) if is_refitd(c)]
    out += [(c, True) for c in spec.get("initContainers", []) if is_refitd(c)]
    return out


def expand(value, container):
    """Expands $(VAR) the way the kubelet does, for plain `value:` env entries; env from
    fieldRef is left as the marker <fieldRef:PATH>."""
    env = {}
    for e in container.get("env", []):
        if "value" in e:
            env[e["name"]] = e["value"]
        elif "valueFrom" in e and "fieldRef" in e["valueFrom"]:
            env[e["name"]] = "<fieldRef:%s>" % e["valueFrom"]["fieldRef"]["fieldPath"]
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)),
                  value)


def mount_at(container, mount_path):
    for m in container.get("volumeMounts", []):
        if posixpath.normpath(m["mountPath"]) == posixpath.normpath(mount_path):
            return m
    return None


def volume(spec, name):
    for v in spec.get("volumes", []):
        if v["name"] == name:
            return v
    raise AssertionError("no volume %r" % name)


def container_port(container, name):
    for p in container.get("ports", []):
        if p.get("name") == name:
            return p["containerPort"]
    return None


def effective_security(spec, container, field):
    return container.get("securityContext", {}).get(
        field, spec.get("securityContext", {}).get(field))


class K8sManifestsTest(unittest.TestCase):

    @classmethod
    def setUpClass(cls):
        cls.manifests = load_all()
        cls.configmaps = {(o["metadata"].get("namespace"), o["metadata"]["name"]): o
                          for o in objects(cls.manifests, "ConfigMap")}

    # ---- helpers that need the loaded manifests ----

    def config_for(self, obj, container):
        """(config dict, origin) a refitd container runs with: the ConfigMap file named by
        --config, then the command-line flags over it (flags win, as in refitd)."""
        spec = pod_spec(obj)
        ns = obj["metadata"].get("namespace")
        args = [expand(a, container) for a in container.get("command", [])[1:] +
                container.get("args", [])]
        config_args = [a for a in args if a.startswith("--config=")]
        self.assertEqual(len(config_args), 1, "%s: one --config= expected" % container["name"])
        config_path = config_args[0].split("=", 1)[1]
        self.assertEqual(config_path, dt.CONFIG_PATH)
        mount = mount_at(container, posixpath.dirname(config_path))
        self.assertIsNotNone(mount, "%s: nothing mounted at %s" % (
            container["name"], posixpath.dirname(config_path)))
        self.assertTrue(mount.get("readOnly"), "the config mount should be readOnly")
        vol = volume(spec, mount["name"])
        self.assertIn("configMap", vol, "the config volume must be a ConfigMap")
        cm = self.configmaps.get((ns, vol["configMap"]["name"]))
        self.assertIsNotNone(cm, "ConfigMap %s/%s is not in deploy/k8s" % (
            ns, vol["configMap"]["name"]))
        key = posixpath.basename(config_path)
        self.assertNotIn("items", vol["configMap"], "mount the whole ConfigMap")
        self.assertIn(key, cm.get("data", {}), "ConfigMap %s has no key %s" % (
            cm["metadata"]["name"], key))
        origin = "ConfigMap %s/%s %s" % (ns, cm["metadata"]["name"], key)
        config = dt.parse_toml(cm["data"][key], origin)
        dt.check_config_values(self, config, origin)
        for a in args:
            if not a.startswith("--") or a.startswith("--config="):
                continue
            flag, _, value = a.partition("=")
            self.assertIn(flag, dt.FLAG_TO_KEY, "unknown refitd flag %s" % flag)
            key = dt.FLAG_TO_KEY[flag]
            if key == "peers":
                value = [p for p in value.split(",") if p]
            elif key == "retain":
                value = int(value)
            config[key] = value
        return config, origin

    def headless_service_for_peers(self, config, ns, origin):
        """The headless Service that each `peers` entry names, as (service, peer port)."""
        peers = config.get("peers")
        self.assertTrue(peers, "%s: peers must name the headless Service" % origin)
        self.assertEqual(len(peers), 1, "%s: one DNS name for all peers" % origin)
        host, port = dt.parse_host_port(peers[0])
        m = re.fullmatch(r"([a-z0-9-]+)\.([a-z0-9-]+)\.svc(\.cluster\.local)?", host)
        self.assertIsNotNone(m, "%s: peer %s is not <service>.<namespace>.svc..." % (
            origin, host))
        svc_name, svc_ns = m.group(1), m.group(2)
        self.assertEqual(svc_ns, ns, "%s: peers Service in another namespace" % origin)
        services = [s for s in objects(self.manifests, "Service")
                    if s["metadata"]["name"] == svc_name and s["metadata"].get("namespace") == ns]
        self.assertEqual(len(services), 1, "%s: no Service %s/%s" % (origin, ns, svc_name))
        svc = services[0]
        self.assertEqual(svc["spec"].get("clusterIP"), "None", "%s must be headless" % svc_name)
        ports = [p for p in svc["spec"]["ports"] if p["port"] == port]
        self.assertEqual(len(ports), 1, "%s: Service %s has no port %d" % (origin, svc_name, port))
        return svc, ports[0]

    def check_refitd_container(self, obj, container, config, origin):
        spec = pod_spec(obj)
        name = "%s/%s" % (obj["metadata"]["name"], container["name"])
        self.assertEqual(container["image"], dt.IMAGE, name)
        self.assertEqual(container["command"][0], dt.DAEMON_BINARY, name)

        # Ports: peer, health and metrics, each from the config, each distinct.
        _, listen_port = host_port(config["listen"])
        health_host, health_port = host_port(config["health_listen"])
        metrics_host, metrics_port = host_port(config["metrics_listen"])
        self.assertEqual(listen_port, dt.PEER_PORT, origin)
        self.assertEqual(health_port, dt.HEALTH_PORT, origin)
        self.assertEqual(metrics_port, dt.METRICS_PORT, origin)
        self.assertEqual(len({listen_port, health_port, metrics_port}), 3,
                         "%s: the health port must serve nothing else" % origin)
        # Every port on the pod IP (downward API status.podIP): reachable by the peers, the
        # kubelet's probes and Prometheus, and not on every interface.
        for key in ("listen", "health_listen", "metrics_listen"):
            host, _ = host_port(config[key])
            self.assertEqual(host, POD_IP, "%s: %s must be on the pod IP" % (origin, key))
        self.check_tls(obj, container, config, origin)
        self.assertEqual(container_port(container, "peer"), listen_port, name)
        self.assertEqual(container_port(container, "health"), health_port, name)
        self.assertEqual(container_port(container, "metrics"), metrics_port, name)

        # Probes: native gRPC probes on the health port; readiness and liveness required.
        for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
            if probe == "startupProbe" and probe not in container:
                continue
            self.assertIn(probe, container, "%s: no %s" % (name, probe))
            p = container[probe]
            self.assertEqual(set(p) & {"grpc", "tcpSocket", "httpGet", "exec"}, {"grpc"},
                             "%s: %s must be a grpc probe" % (name, probe))
            port = p["grpc"]["port"]
            if isinstance(port, str):
                port = container_port(container, port)
            self.assertEqual(port, health_port,
                             "%s: %s port must equal health_listen's port" % (name, probe))
            self.assertIn(p["grpc"].get("service", ""), ("",),
                          "%s: probe the server's overall health (service \"\")" % name)

        # Prometheus scraping of the metrics port.
        ann = pod_annotations(obj)
        self.assertEqual(ann.get("prometheus.io/scrape"), "true", name)
        self.assertEqual(ann.get("prometheus.io/port"), str(metrics_port), name)
        self.assertEqual(ann.get("prometheus.io/path"), "/metrics", name)

        # The socket directory is a volume mount, so clients can share it.
        socket_dir = posixpath.dirname(config["socket"])
        mount = mount_at(container, socket_dir)
        self.assertIsNotNone(mount, "%s: socket dir %s not mounted" % (name, socket_dir))
        self.assertFalse(mount.get("readOnly"), "%s: the daemon writes its socket" % name)

        # Resources and a locked-down container.
        requests = container.get("resources", {}).get("requests", {})
        self.assertIn("cpu", requests, name)
        self.assertIn("memory", requests, name)
        self.assertNotIn("memory", container.get("resources", {}).get("limits", {}),
                         "%s: a memory limit would OOM-kill the daemon holding snapshots" % name)
        sc = container.get("securityContext", {})
        self.assertIs(effective_security(spec, container, "runAsNonRoot"), True, name)
        self.assertIs(sc.get("allowPrivilegeEscalation"), False, name)
        self.assertIs(sc.get("readOnlyRootFilesystem"), True, name)
        self.assertEqual(sc.get("capabilities", {}).get("drop"), ["ALL"], name)
        self.assertFalse(sc.get("privileged", False), name)
        self.assertFalse(sc.get("capabilities", {}).get("add"), name)
        return mount

    def check_tls(self, obj, container, config, origin):
        """Mutual TLS with this pod's certificate from cert-manager's CSI driver: CN = the
        pod's name = --node, signed by an Issuer of the manifests, usable as client and
        server, its key readable by the daemon's group."""
        spec = pod_spec(obj)
        name = "%s/%s" % (obj["metadata"]["name"], container["name"])
        self.assertEqual(config.get("node"), POD_NAME,
                         "%s: --node must be the pod's name, which the certificate names" % name)
        self.assertNotIn("allow_plaintext_peers", config, name)
        files = {key: config.get(key) for key in ("tls_cert", "tls_key", "tls_ca")}
        self.assertTrue(all(files.values()), "%s: no --tls-*: %r" % (name, files))
        dirs = {posixpath.dirname(f) for f in files.values()}
        self.assertEqual(len(dirs), 1, name)
        mount = mount_at(container, dirs.pop())
        self.assertIsNotNone(mount, "%s: nothing mounted at the TLS files' directory" % name)
        self.assertTrue(mount.get("readOnly"), name)
        csi = volume(spec, mount["name"]).get("csi")
        self.assertIsNotNone(csi, "%s: the TLS volume must be a CSI volume" % name)
        self.assertEqual(csi["driver"], CSI_DRIVER)
        self.assertIs(csi.get("readOnly"), True, "csi-driver volumes are readOnly")
        attrs = csi["volumeAttributes"]
        # The driver's default file names.
        self.assertEqual({k: posixpath.basename(v) for k, v in files.items()},
                         {"tls_cert": "tls.crt", "tls_key": "tls.key", "tls_ca": "ca.crt"})
        self.assertEqual(attrs.get("csi.cert-manager.io/common-name"), "${POD_NAME}", name)
        usages = {u.strip() for u in attrs["csi.cert-manager.io/key-usages"].split(",")}
        self.assertTrue({"server auth", "client auth"} <= usages, usages)
        self.assertEqual(attrs.get("csi.cert-manager.io/fs-group"),
                         str(effective_security(spec, container, "runAsGroup")), name)
        self.assertEqual(attrs.get("csi.cert-manager.io/issuer-kind"), "Issuer")
        ns = obj["metadata"]["namespace"]
        issuers = [i for i in objects(self.manifests, "Issuer")
                   if i["metadata"]["name"] == attrs["csi.cert-manager.io/issuer-name"]
                   and i["metadata"]["namespace"] == ns]
        self.assertEqual(len(issuers), 1, "%s: no Issuer %s in %s" % (
            name, attrs["csi.cert-manager.io/issuer-name"], ns))
        # A CA Issuer whose Secret a CA Certificate in the same namespace fills.
        secret = issuers[0]["spec"]["ca"]["secretName"]
        cas = [c for c in objects(self.manifests, "Certificate")
               if c["metadata"]["namespace"] == ns and c["spec"]["secretName"] == secret]
        self.assertEqual(len(cas), 1, name)
        self.assertIs(cas[0]["spec"].get("isCA"), True)

    # ---- every manifest ----

    def test_every_manifest_parses_and_is_a_known_kind(self):
        self.assertTrue(self.manifests, "no manifests under deploy/k8s")
        for f, docs in self.manifests.items():
            self.assertTrue(docs, "%s is empty" % f)
            for d in docs:
                self.assertIn(d.get("kind"), KNOWN_KINDS, f)
                self.assertIn("apiVersion", d, f)
                if d["kind"] == "Kustomization":
                    continue
                self.assertTrue(d.get("metadata", {}).get("name"), f)
                if d["kind"] in NAMESPACED:
                    expected = "rl-example" if "/examples/" in f else "refit"
                    self.assertEqual(d["metadata"].get("namespace"), expected, f)

    def test_api_versions(self):
        expected = {"Namespace": "v1", "ConfigMap": "v1", "Service": "v1", "Pod": "v1",
                    "DaemonSet": "apps/v1", "Issuer": "cert-manager.io/v1",
                    "Certificate": "cert-manager.io/v1",
                    "Kustomization": "kustomize.config.k8s.io/v1beta1"}
        for d in objects(self.manifests):
            self.assertEqual(d["apiVersion"], expected[d["kind"]], d.get("metadata"))

    def test_kustomization_lists_every_base_manifest(self):
        kust = dt.load_yaml_documents("deploy/k8s/kustomization.yaml")[0]
        top = {os.path.basename(f) for f in dt.k8s_manifest_files(recursive=False)}
        top.discard("kustomization.yaml")
        self.assertEqual(set(kust["resources"]), top)
        kinds = {d["kind"] for f in kust["resources"]
                 for d in dt.load_yaml_documents("deploy/k8s/" + f)}
        self.assertEqual(kinds, {"Namespace", "ConfigMap", "Service", "DaemonSet", "Issuer",
                                 "Certificate"})

    def test_namespaces_allow_host_ipc(self):
        for ns in objects(self.manifests, "Namespace"):
            labels = ns["metadata"].get("labels", {})
            self.assertEqual(labels.get("pod-security.kubernetes.io/enforce"), "privileged",
                             "%s: hostIPC/hostPath pods need the privileged level"
                             % ns["metadata"]["name"])
        names = {ns["metadata"]["name"] for ns in objects(self.manifests, "Namespace")}
        self.assertEqual(names, {"refit", "rl-example"})

    # ---- the DaemonSet ----

    def daemonsets(self):
        """{role: DaemonSet}: refitd-trainer and refitd-engine."""
        ds = {d["metadata"]["labels"].get("refit.dev/role"): d
              for d in objects(self.manifests, "DaemonSet")}
        self.assertEqual(set(ds), {"trainer", "engine"})
        self.assertEqual({d["metadata"]["name"] for d in ds.values()},
                         {"refitd-trainer", "refitd-engine"})
        return ds

    def daemonset(self):
        return self.daemonsets()["engine"]

    def test_daemonset_version_label_is_the_image_tag(self):
        # Both say which release runs: VERSION, what scripts/ship/build-image.sh tags the image with.
        for ds in self.daemonsets().values():
            labels = ds["metadata"]["labels"]
            self.assertEqual(labels.get("app.kubernetes.io/version"), dt.version())
        self.assertEqual(dt.IMAGE.rsplit(":", 1)[1], dt.version())

    def test_daemonsets_split_the_nodes(self):
        # Trainer nodes (labelled) run refitd-trainer, every other GPU node refitd-engine; the
        # two selectors never pick the same pods.
        ds = self.daemonsets()
        trainer, engine = pod_spec(ds["trainer"]), pod_spec(ds["engine"])
        self.assertEqual(trainer["nodeSelector"].get("refit.dev/role"), "trainer")
        self.assertNotIn("refit.dev/role", engine["nodeSelector"])
        terms = engine["affinity"]["nodeAffinity"][
            "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
        self.assertEqual(len(terms), 1)
        self.assertIn({"key": "refit.dev/role", "operator": "NotIn", "values": ["trainer"]},
                      terms[0]["matchExpressions"])
        self.assertFalse(selects(ds["trainer"]["spec"]["selector"]["matchLabels"],
                                 pod_labels(ds["engine"])))
        self.assertFalse(selects(ds["engine"]["spec"]["selector"]["matchLabels"],
                                 pod_labels(ds["trainer"])))

    def test_daemonset_on_gpu_nodes(self):
        for ds in self.daemonsets().values():
            with self.subTest(daemonset=ds["metadata"]["name"]):
                self.check_daemonset_on_gpu_nodes(ds)

    def check_daemonset_on_gpu_nodes(self, ds):
        spec = pod_spec(ds)
        self.assertTrue(selects(ds["spec"]["selector"]["matchLabels"], pod_labels(ds)))
        gpu_selector = spec.get("nodeSelector", {})
        affinity = spec.get("affinity", {}).get("nodeAffinity", {})
        self.assertTrue(any("gpu" in k for k in gpu_selector) or "gpu" in str(affinity),
                        "the DaemonSet must select GPU nodes")
        tolerated = [t for t in spec.get("tolerations", []) if t.get("key") == "nvidia.com/gpu"]
        self.assertTrue(tolerated, "no toleration for the nvidia.com/gpu taint")
        for t in tolerated:
            self.assertEqual(t.get("operator"), "Exists")
        self.assertIs(spec.get("hostIPC"), True, "refitd needs the node's IPC namespace/shm")
        # With hostIPC the runtime bind-mounts the node's /dev/shm, unless a volume is
        # mounted there, which would hide it.
        for c in spec["containers"] + spec.get("initContainers", []):
            self.assertIsNone(mount_at(c, "/dev/shm"), c["name"])
        self.assertFalse(spec.get("hostNetwork", False))
        self.assertFalse(spec.get("hostPID", False))
        # The DaemonSet does not take GPUs away from the scheduler.
        for c in spec["containers"]:
            for section in ("requests", "limits"):
                self.assertNotIn("nvidia.com/gpu", c.get("resources", {}).get(section, {}))

    def test_daemonset_refitd_container(self):
        for ds in self.daemonsets().values():
            with self.subTest(daemonset=ds["metadata"]["name"]):
                self.check_daemonset_refitd_container(ds)

    def check_daemonset_refitd_container(self, ds):
        spec = pod_spec(ds)
        found = refitd_containers(spec)
        self.assertEqual([(c["name"], init) for c, init in found], [("refitd", False)])
        container = found[0][0]
        config, origin = self.config_for(ds, container)
        self.assertEqual(config["socket"], dt.SOCKET_PATH, origin)
        self.assertIn("node", config, "--node should be the pod's name (its certificate's)")
        mount = self.check_refitd_container(ds, container, config, origin)

        # --state-dir on the node (hostPath), writable, handed to the daemon by the init
        # container: a restarted pod keeps each model's newest version.
        state = config.get("state_dir")
        self.assertTrue(state, "%s: no state_dir" % origin)
        state_mount = mount_at(container, state)
        self.assertIsNotNone(state_mount, "%s: nothing mounted at %s" % (origin, state))
        self.assertFalse(state_mount.get("readOnly"))
        state_vol = volume(spec, state_mount["name"])
        self.assertEqual(state_vol.get("hostPath", {}).get("path"), state)
        self.assertEqual(state_vol["hostPath"].get("type"), "DirectoryOrCreate")

        # The socket directory is the node's /run/refit, so client pods see the socket.
        vol = volume(spec, mount["name"])
        self.assertIn("hostPath", vol)
        self.assertEqual(vol["hostPath"]["path"], posixpath.dirname(dt.SOCKET_PATH))
        self.assertEqual(vol["hostPath"].get("type"), "DirectoryOrCreate")

        # The init container hands that directory to the daemon's uid:gid.
        uid = effective_security(spec, container, "runAsUser")
        gid = effective_security(spec, container, "runAsGroup")
        self.assertIsInstance(uid, int)
        self.assertNotEqual(uid, 0)
        self.assertIsInstance(gid, int)
        inits = spec.get("initContainers", [])
        self.assertEqual(len(inits), 1)
        init = inits[0]
        self.assertNotEqual(init.get("restartPolicy"), "Always", "a one-shot init container")
        script = " ".join(init["command"] + init.get("args", []))
        self.assertIn("chown %d:%d %s %s" % (uid, gid, posixpath.dirname(dt.SOCKET_PATH),
                                             state), script)
        self.assertIsNotNone(mount_at(init, state))
        self.assertRegex(script, r"chmod 0?7[57]0 ")
        init_mount = mount_at(init, posixpath.dirname(dt.SOCKET_PATH))
        self.assertIsNotNone(init_mount)
        self.assertEqual(init_mount["name"], mount["name"])
        self.assertEqual(init["securityContext"]["capabilities"]["drop"], ["ALL"])
        self.assertEqual(init["securityContext"]["capabilities"].get("add"), ["CHOWN"])

    def test_engines_peer_with_the_trainer_nodes_only(self):
        # Bounded by default: an engine daemon's --peers is one headless Service that selects
        # the trainer daemons and no engine daemon; trainer daemons name no peers.
        ds = self.daemonsets()
        trainer = refitd_containers(pod_spec(ds["trainer"]))[0][0]
        trainer_config, origin = self.config_for(ds["trainer"], trainer)
        self.assertFalse(trainer_config.get("peers"), "%s: trainers need no --peers" % origin)
        container = refitd_containers(pod_spec(ds["engine"]))[0][0]
        config, origin = self.config_for(ds["engine"], container)
        self.assertEqual(len(config["peers"]), 1, origin)
        svc, port = self.headless_service_for_peers(config, "refit", origin)
        self.assertEqual(svc["metadata"]["name"], "refitd-trainers")
        self.assertTrue(selects(svc["spec"]["selector"], pod_labels(ds["trainer"])),
                        "the Service must select the trainer daemons")
        self.assertFalse(selects(svc["spec"]["selector"], pod_labels(ds["engine"])),
                         "the Service must not select engine daemons (a full mesh)")
        self.assertEqual(svc["spec"]["selector"], ds["trainer"]["spec"]["selector"]["matchLabels"])
        target = port.get("targetPort", port["port"])
        if isinstance(target, str):
            target = container_port(trainer, target)
        self.assertEqual(target, host_port(trainer_config["listen"])[1])
        # It selects the daemons and nothing else (not the sidecar examples' pods).
        for pod in objects(self.manifests, "Pod"):
            self.assertFalse(selects(svc["spec"]["selector"], pod_labels(pod)),
                             pod["metadata"]["name"])

    # ---- the examples ----

    def sidecar_pods(self):
        pods = {p["metadata"]["name"]: p for p in objects(self.manifests, "Pod")
                if refitd_containers(pod_spec(p))}
        return pods

    def test_examples_present(self):
        files = set(dt.k8s_manifest_files("deploy/k8s/examples"))
        for f in ("trainer-pod.yaml", "inference-pod.yaml", "sidecar-configmap.yaml",
                  "sidecar-peers-service.yaml", "daemonset-client-pod.yaml", "namespace.yaml",
                  "tls.yaml"):
            self.assertIn("deploy/k8s/examples/" + f, files)
        self.assertEqual(set(self.sidecar_pods()), {"trainer-0", "inference-0"})

    def test_native_sidecars(self):
        for name, pod in self.sidecar_pods().items():
            with self.subTest(pod=name):
                spec = pod_spec(pod)
                found = refitd_containers(spec)
                self.assertEqual(len(found), 1)
                sidecar, is_init = found[0]
                self.assertTrue(is_init, "refitd must be an initContainer (native sidecar)")
                self.assertEqual(sidecar.get("restartPolicy"), "Always",
                                 "a native sidecar has restartPolicy: Always")
                config, origin = self.config_for(pod, sidecar)
                self.assertEqual(config.get("node"), POD_NAME)
                socket_mount = self.check_refitd_container(pod, sidecar, config, origin)
                self.assertIn("emptyDir", volume(spec, socket_mount["name"]))
                self.assertFalse(spec.get("hostIPC", False), "sidecar pods share IPC in-pod")

                mains = spec["containers"]
                self.assertEqual(len(mains), 1)
                main = mains[0]
                # The main container reaches the sidecar's socket...
                m = mount_at(main, posixpath.dirname(config["socket"]))
                self.assertIsNotNone(m, "%s does not mount the socket dir" % main["name"])
                self.assertEqual(m["name"], socket_mount["name"])
                env = {e["name"]: e.get("value") for e in main.get("env", [])}
                self.assertEqual(env.get("REFIT_SOCKET"), config["socket"])
                # ...and shares a memory-backed /dev/shm with it.
                shm_d, shm_m = mount_at(sidecar, "/dev/shm"), mount_at(main, "/dev/shm")
                self.assertIsNotNone(shm_d)
                self.assertIsNotNone(shm_m)
                self.assertEqual(shm_d["name"], shm_m["name"])
                shm_vol = volume(spec, shm_d["name"])
                self.assertEqual(shm_vol.get("emptyDir", {}).get("medium"), "Memory")
                self.assertIn("sizeLimit", shm_vol["emptyDir"])
                # Same uid and gid, so the daemon can open the client's shm buffers.
                for field in ("runAsUser", "runAsGroup"):
                    self.assertIsNotNone(effective_security(spec, main, field), field)
                    self.assertEqual(effective_security(spec, sidecar, field),
                                     effective_security(spec, main, field), field)
                self.assertEqual(spec["securityContext"].get("fsGroup"),
                                 effective_security(spec, sidecar, "runAsGroup"))
                self.assertIn("nvidia.com/gpu", main["resources"]["limits"])

                if name == "trainer-0":
                    self.assertFalse(config.get("peers"), "the trainer needs no --peers")
                    continue
                # The inference pod peers with the job's trainer pods only.
                svc, port = self.headless_service_for_peers(config, "rl-example", origin)
                self.assertEqual(port.get("targetPort"), "peer")
                pods = self.sidecar_pods()
                self.assertTrue(selects(svc["spec"]["selector"], pod_labels(pods["trainer-0"])))
                self.assertFalse(selects(svc["spec"]["selector"], pod_labels(pod)))
        # The sidecar Service does not also pick up the node daemons.
        svc = [s for s in objects(self.manifests, "Service")
               if s["metadata"]["name"] == "rl-example-trainers"][0]
        for ds in self.daemonsets().values():
            self.assertFalse(selects(svc["spec"]["selector"], pod_labels(ds)))

    def test_daemonset_client_pod(self):
        pods = [p for p in objects(self.manifests, "Pod")
                if p["metadata"]["name"] == "trainer-on-node-daemon"]
        self.assertEqual(len(pods), 1)
        pod = pods[0]
        spec = pod_spec(pod)
        self.assertEqual(refitd_containers(spec), [])
        self.assertIs(spec.get("hostIPC"), True, "shm buffers must be in the node's /dev/shm")
        for c in spec["containers"] + spec.get("initContainers", []):
            self.assertIsNone(mount_at(c, "/dev/shm"), "%s: a volume at /dev/shm hides the "
                              "node's /dev/shm that hostIPC brings" % c["name"])
        ds = self.daemonset()
        ds_container = refitd_containers(pod_spec(ds))[0][0]
        ds_config, _ = self.config_for(ds, ds_container)
        ds_socket_vol = volume(pod_spec(ds), mount_at(
            ds_container, posixpath.dirname(ds_config["socket"]))["name"])
        main = spec["containers"][0]
        m = mount_at(main, posixpath.dirname(ds_config["socket"]))
        self.assertIsNotNone(m)
        self.assertTrue(m.get("readOnly"))
        vol = volume(spec, m["name"])
        self.assertEqual(vol["hostPath"]["path"], ds_socket_vol["hostPath"]["path"])
        env = {e["name"]: e.get("value") for e in main.get("env", [])}
        self.assertEqual(env.get("REFIT_SOCKET"), ds_config["socket"])
        self.assertEqual(effective_security(spec, main, "runAsGroup"),
                         effective_security(pod_spec(ds), ds_container, "runAsGroup"),
                         "the client's primary group must be the daemon's group")
        self.assertIn("umask 0007", " ".join(main["command"]))

    def test_configmaps_are_complete(self):
        for (ns, name), cm in self.configmaps.items():
            with self.subTest(configmap=name):
                config = dt.parse_toml(cm["data"]["refitd.toml"], name)
                dt.check_config_values(self, config, name)
                for key in ("socket", "listen", "metrics_listen", "health_listen", "tls_cert",
                            "tls_key", "tls_ca"):
                    self.assertIn(key, config, "%s: %s" % (name, key))
                self.assertEqual(config["socket"], dt.SOCKET_PATH)
                self.assertNotIn("node", config, "%s: --node comes from the pod" % name)
                # Loopback in the file: the pods put the ports on the pod IP on the command
                # line; never every interface, never plaintext off loopback.
                for key in ("listen", "metrics_listen", "health_listen"):
                    self.assertEqual(dt.parse_host_port(config[key])[0], "127.0.0.1")
                self.assertNotIn("allow_plaintext_peers", config)


if __name__ == "__main__":
    dt.main()
