//! The Kubernetes manifests parse and carry what a production rollout needs: readiness that standbys
//! pass, a PodDisruptionBudget that lets drains proceed, anti-affinity, a locked-down security
//! context, resources, no service account token, the takeover delay for MySQL, a pinned image.
//! YAML is read with python3's yaml module (the test suite already needs python3) into JSON.

use std::process::Command;

use serde_json::Value;

fn manifests() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/packaging/kubernetes/deployment.yaml"
    );
    let out = Command::new("python3")
        .args([
            "-c",
            "import json, sys, yaml; print(json.dumps(list(yaml.safe_load_all(open(sys.argv[1])))))",
            path,
        ])
        .output()
        .expect("python3 is not installed");
    assert!(
        out.status.success(),
        "the manifests do not parse (python3-yaml installed?): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn of_kind<'a>(docs: &'a [Value], kind: &str) -> &'a Value {
    docs.iter()
        .find(|d| d["kind"] == kind)
        .unwrap_or_else(|| panic!("no {kind} in the manifests"))
}

#[test]
fn the_deployment_rolls_out_drains_and_runs_locked_down() {
    let docs = manifests();
    let deployment = of_kind(&docs, "Deployment");
    let spec = &deployment["spec"];
    let pod = &spec["template"]["spec"];
    let labels = &spec["template"]["metadata"]["labels"];
    assert_eq!(&spec["selector"]["matchLabels"], labels);
    let replicas = spec["replicas"].as_u64().unwrap();
    assert!(replicas >= 2, "a standby needs a second replica");

    let containers = pod["containers"].as_array().unwrap();
    assert_eq!(containers.len(), 1);
    let c = &containers[0];
    // Readiness is the guard's health, which standbys pass; /leader would keep them unready forever.
    assert_eq!(c["readinessProbe"]["httpGet"]["path"], "/healthz");
    assert_eq!(c["livenessProbe"]["httpGet"]["path"], "/healthz");
    assert!(!serde_json::to_string(deployment)
        .unwrap()
        .contains("/leader"));
    let command: Vec<&str> = c["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert!(command.contains(&"--wait"), "{command:?}");

    let image = c["image"].as_str().unwrap();
    let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or("");
    assert!(
        !tag.is_empty() && tag != "latest" && !tag.contains('/'),
        "image not pinned: {image}"
    );

    assert_eq!(pod["automountServiceAccountToken"], false);
    assert_eq!(pod["securityContext"]["runAsNonRoot"], true);
    assert!(pod["securityContext"]["runAsUser"].as_u64().unwrap() > 0);
    let sc = &c["securityContext"];
    assert_eq!(sc["readOnlyRootFilesystem"], true);
    assert_eq!(sc["allowPrivilegeEscalation"], false);
    assert_eq!(sc["capabilities"]["drop"], serde_json::json!(["ALL"]));
    for key in ["requests", "limits"] {
        assert!(c["resources"][key].is_object(), "no resources.{key}");
    }

    let anti = &pod["affinity"]["podAntiAffinity"];
    let terms = anti["requiredDuringSchedulingIgnoredDuringExecution"]
        .as_array()
        .or_else(|| anti["preferredDuringSchedulingIgnoredDuringExecution"].as_array())
        .expect("no pod anti-affinity");
    assert!(terms.iter().any(|t| {
        let term = if t["podAffinityTerm"].is_object() {
            &t["podAffinityTerm"]
        } else {
            t
        };
        term["topologyKey"] == "kubernetes.io/hostname"
            && &term["labelSelector"]["matchLabels"] == labels
    }));

    // The takeover delay the guarantees page asks for where MySQL can drop a lock server-side.
    let env = c["env"].as_array().unwrap();
    let var = |name: &str| {
        env.iter()
            .find(|e| e["name"] == name)
            .and_then(|e| e["value"].as_str())
    };
    let secret = of_kind(&docs, "Secret");
    if secret["stringData"]["url"]
        .as_str()
        .unwrap()
        .starts_with("mysql://")
    {
        let delay = humantime::parse_duration(
            var("SENTINEL_GUARD_TAKEOVER_DELAY").expect("no takeover delay"),
        )
        .unwrap();
        let grace = humantime::parse_duration(var("SENTINEL_GUARD_GRACE_PERIOD").unwrap()).unwrap();
        assert!(
            delay > grace,
            "takeover delay {delay:?} must exceed the grace period {grace:?}"
        );
    }
    let grace = humantime::parse_duration(var("SENTINEL_GUARD_GRACE_PERIOD").unwrap()).unwrap();
    assert!(pod["terminationGracePeriodSeconds"].as_u64().unwrap() > grace.as_secs() + 5);
}

#[test]
fn the_disruption_budget_lets_a_drain_evict_one_replica() {
    let docs = manifests();
    let deployment = of_kind(&docs, "Deployment");
    let pdb = of_kind(&docs, "PodDisruptionBudget");
    assert_eq!(pdb["apiVersion"], "policy/v1");
    assert_eq!(
        pdb["spec"]["selector"]["matchLabels"],
        deployment["spec"]["template"]["metadata"]["labels"]
    );
    let replicas = deployment["spec"]["replicas"].as_u64().unwrap();
    let allowed = match (
        pdb["spec"]["maxUnavailable"].as_u64(),
        pdb["spec"]["minAvailable"].as_u64(),
    ) {
        (Some(max_unavailable), _) => max_unavailable,
        (None, Some(min_available)) => replicas.saturating_sub(min_available),
        _ => panic!("the budget names neither maxUnavailable nor minAvailable as a number"),
    };
    assert!(
        allowed >= 1,
        "the budget allows no disruption: drains would block"
    );
}
