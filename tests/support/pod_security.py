"""Pod Security Standards, ``restricted`` profile: a stand-in for the API server's pod-security admission.

No cluster runs here, so the rules are copied (as Python over pod specs in their JSON form) from Kubernetes'
pod-security-admission, github.com/kubernetes/pod-security-admission at commit 8f84a87c (2026-07-01), directory
``policy/``, the newest version of each check (what a current cluster with ``enforce: restricted`` applies; the
``restricted`` level runs every ``baseline`` check too, except those a restricted check overrides):

==============================  ==========================================  ====================================
check (ID upstream)             file                                        level / overrides
==============================  ==========================================  ====================================
hostNamespaces                  check_hostNamespaces.go                     baseline
privileged                      check_privileged.go                         baseline
hostPorts                       check_hostPorts.go                          baseline
appArmorProfile                 check_appArmorProfile.go                    baseline
seLinuxOptions                  check_seLinuxOptions.go (1.31 types)        baseline
procMount                       check_procMount_baseline.go (1.35)          baseline
sysctls                         check_sysctls.go (1.37 allowed set)         baseline
windowsHostProcess              check_windowsHostProcess.go                 baseline
hostProbesAndHostLifecycle      check_hostProbesAndhostLifecycle.go         baseline
restrictedVolumes               check_restrictedVolumes.go                  restricted, overrides hostPathVolumes
capabilities_restricted         check_capabilities_restricted.go (1.25)     restricted, overrides capabilities
allowPrivilegeEscalation        check_allowPrivilegeEscalation.go (1.25)    restricted
runAsNonRoot                    check_runAsNonRoot.go (1.35)                restricted
runAsUser                       check_runAsUser.go (1.35)                   restricted
seccompProfile_restricted       check_seccompProfile_restricted.go (1.25)   restricted, overrides seccomp
==============================  ==========================================  ====================================

Containers are visited as ``visitContainers`` in ``policy/visitor.go`` does (init, regular, ephemeral);
``relaxPolicyForUserNamespacePod`` (``policy/helpers.go``) exempts a pod with ``hostUsers: false`` from
runAsNonRoot, runAsUser and procMount. Messages follow upstream's ``ForbiddenReason: ForbiddenDetail`` shape.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

Pod = Mapping[str, Any]
_SYSCTLS = frozenset(
    {
        *("kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.tcp_syncookies"),
        *("net.ipv4.ping_group_range", "net.ipv4.ip_unprivileged_port_start", "net.ipv4.ip_local_reserved_ports"),
        *("net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl"),
        *("net.ipv4.tcp_keepalive_probes", "net.ipv4.tcp_rmem", "net.ipv4.tcp_wmem"),
        *("net.ipv4.tcp_slow_start_after_idle", "net.ipv4.tcp_notsent_lowat"),
    }
)
_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
_VOLUMES = frozenset(
    {
        "configMap",
        "csi",
        "downwardAPI",
        "emptyDir",
        "ephemeral",
        "image",
        "persistentVolumeClaim",
        "projected",
        "secret",
    }
)


def _containers(pod: Pod) -> Iterator[Mapping[str, Any]]:
    for field in ("initContainers", "containers", "ephemeralContainers"):
        yield from pod.get(field) or []


def _sc(obj: Mapping[str, Any]) -> Mapping[str, Any]:
    return obj.get("securityContext") or {}


def _windows(pod: Pod) -> bool:
    return (pod.get("os") or {}).get("name") == "windows"


def _user_namespace(pod: Pod) -> bool:
    return pod.get("hostUsers") is False


def _bad(pod: Pod, test: Callable[[Mapping[str, Any]], bool]) -> list[str]:
    return [c.get("name", "") for c in _containers(pod) if test(c)]


def host_namespaces(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    found = [f"{k}=true" for k in ("hostNetwork", "hostPID", "hostIPC") if pod.get(k)]
    return f"host namespaces: {', '.join(found)}" if found else None


def privileged(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    bad = _bad(pod, lambda c: _sc(c).get("privileged") is True)
    return f"privileged: containers {bad} must not set securityContext.privileged=true" if bad else None


def host_ports(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    bad = _bad(pod, lambda c: any(p.get("hostPort") for p in c.get("ports") or []))
    return f"hostPort: containers {bad} use hostPorts" if bad else None


def app_armor_profile(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    def bad_type(sc: Mapping[str, Any]) -> bool:
        profile = sc.get("appArmorProfile")
        return profile is not None and profile.get("type") not in ("RuntimeDefault", "Localhost")

    setters = ["pod"] if bad_type(_sc(pod)) else []
    setters += _bad(pod, lambda c: bad_type(_sc(c)))
    prefix = "container.apparmor.security.beta.kubernetes.io/"
    annotations = [
        k
        for k, v in (meta.get("annotations") or {}).items()
        if k.startswith(prefix) and not (v == "" or v == "runtime/default" or v.startswith("localhost/"))
    ]
    if setters or annotations:
        return f"forbidden AppArmor profile: {setters + annotations} must not set AppArmor profile type"
    return None


def se_linux_options(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    def bad(sc: Mapping[str, Any]) -> bool:
        opts = sc.get("seLinuxOptions")
        return opts is not None and (
            opts.get("type", "") not in _SELINUX_TYPES or bool(opts.get("user")) or bool(opts.get("role"))
        )

    setters = (["pod"] if bad(_sc(pod)) else []) + _bad(pod, lambda c: bad(_sc(c)))
    return f"seLinuxOptions: {setters} set forbidden seLinuxOptions" if setters else None


def proc_mount(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    if _user_namespace(pod):
        return None
    bad = _bad(pod, lambda c: _sc(c).get("procMount") not in (None, "Default"))
    return f"procMount: containers {bad} must not set securityContext.procMount" if bad else None


def sysctls(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    bad = [s.get("name") for s in _sc(pod).get("sysctls") or [] if s.get("name") not in _SYSCTLS]
    return f"forbidden sysctls: {', '.join(map(str, bad))}" if bad else None


def windows_host_process(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    def bad(sc: Mapping[str, Any]) -> bool:
        return (sc.get("windowsOptions") or {}).get("hostProcess") is True

    setters = (["pod"] if bad(_sc(pod)) else []) + _bad(pod, lambda c: bad(_sc(c)))
    return f"hostProcess: {setters} must not set securityContext.windowsOptions.hostProcess=true" if setters else None


def host_probes_and_host_lifecycle(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    def hosts(handler: Mapping[str, Any] | None) -> bool:
        handler = handler or {}
        return bool((handler.get("httpGet") or {}).get("host") or (handler.get("tcpSocket") or {}).get("host"))

    def bad(c: Mapping[str, Any]) -> bool:
        life = c.get("lifecycle") or {}
        probes = [c.get(p) for p in ("livenessProbe", "readinessProbe", "startupProbe")]
        return any(hosts(h) for h in (*probes, life.get("postStart"), life.get("preStop")))

    found = _bad(pod, bad)
    return f"probe or lifecycle host: containers {found} set a host" if found else None


def restricted_volumes(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    bad = {
        v.get("name"): sorted(set(v) - {"name"} - _VOLUMES) or ["unknown"]
        for v in pod.get("volumes") or []
        if not set(v) & _VOLUMES
    }
    return f"restricted volume types: {bad}" if bad else None


def capabilities_restricted(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    if _windows(pod):
        return None
    missing = _bad(pod, lambda c: "ALL" not in ((_sc(c).get("capabilities") or {}).get("drop") or []))
    adding = _bad(
        pod, lambda c: any(a != "NET_BIND_SERVICE" for a in (_sc(c).get("capabilities") or {}).get("add") or [])
    )
    details = [f'containers {missing} must set securityContext.capabilities.drop=["ALL"]'] if missing else []
    details += [f"containers {adding} must not add capabilities other than NET_BIND_SERVICE"] if adding else []
    return f"unrestricted capabilities: {'; '.join(details)}" if details else None


def allow_privilege_escalation(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    if _windows(pod):
        return None
    bad = _bad(pod, lambda c: _sc(c).get("allowPrivilegeEscalation") is not False)
    return (
        f"allowPrivilegeEscalation != false: containers {bad} must set securityContext.allowPrivilegeEscalation=false"
        if bad
        else None
    )


def run_as_non_root(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    if _user_namespace(pod):
        return None
    pod_value = _sc(pod).get("runAsNonRoot")
    explicit = ["pod"] if pod_value is False else []
    explicit += _bad(pod, lambda c: _sc(c).get("runAsNonRoot") is False)
    if explicit:
        return f"runAsNonRoot != true: {explicit} must not set securityContext.runAsNonRoot=false"
    implicit = [] if pod_value is True else _bad(pod, lambda c: _sc(c).get("runAsNonRoot") is None)
    if implicit:
        return f"runAsNonRoot != true: pod or containers {implicit} must set securityContext.runAsNonRoot=true"
    return None


def run_as_user(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    if _user_namespace(pod):
        return None
    setters = (["pod"] if _sc(pod).get("runAsUser") == 0 else []) + _bad(pod, lambda c: _sc(c).get("runAsUser") == 0)
    return f"runAsUser=0: {setters} must not set runAsUser=0" if setters else None


def seccomp_profile_restricted(pod: Pod, meta: Mapping[str, Any]) -> str | None:
    if _windows(pod):
        return None

    def valid(sc: Mapping[str, Any]) -> bool:
        return (sc.get("seccompProfile") or {}).get("type") in ("RuntimeDefault", "Localhost")

    pod_profile = _sc(pod).get("seccompProfile")
    explicit = ["pod"] if pod_profile is not None and not valid(_sc(pod)) else []
    explicit += _bad(pod, lambda c: _sc(c).get("seccompProfile") is not None and not valid(_sc(c)))
    if explicit:
        return f"seccompProfile: {explicit} must not set securityContext.seccompProfile.type to a bad value"
    pod_set = pod_profile is not None
    implicit = [] if pod_set else _bad(pod, lambda c: _sc(c).get("seccompProfile") is None)
    if implicit:
        return (
            f"seccompProfile: pod or containers {implicit} must set securityContext.seccompProfile.type to "
            '"RuntimeDefault" or "Localhost"'
        )
    return None


CHECKS: dict[str, Callable[[Pod, Mapping[str, Any]], str | None]] = {
    "hostNamespaces": host_namespaces,
    "privileged": privileged,
    "hostPorts": host_ports,
    "appArmorProfile": app_armor_profile,
    "seLinuxOptions": se_linux_options,
    "procMount": proc_mount,
    "sysctls": sysctls,
    "windowsHostProcess": windows_host_process,
    "hostProbesAndHostLifecycle": host_probes_and_host_lifecycle,
    "restrictedVolumes": restricted_volumes,
    "capabilities_restricted": capabilities_restricted,
    "allowPrivilegeEscalation": allow_privilege_escalation,
    "runAsNonRoot": run_as_non_root,
    "runAsUser": run_as_user,
    "seccompProfile_restricted": seccomp_profile_restricted,
}


def restricted_violations(pod: Pod, metadata: Mapping[str, Any] | None = None) -> list[str]:
    """``<check>: <reason and detail>`` for every ``restricted`` check the pod spec fails; empty when it passes."""
    found = ((check, rule(pod, metadata or {})) for check, rule in CHECKS.items())
    return [f"{check}: {reason}" for check, reason in found if reason]
