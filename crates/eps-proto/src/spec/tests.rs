//! Specs parsed, checked, and their errors named.

use super::*;
use eps_agg::Decay;

#[test]
fn a_nodes_rdma_device_comes_from_its_entry_else_the_default() {
    let s = JobSpec::from_toml(
        "[job]\n[model]\ndeclare = true\n[fabric]\nrdma_device = \"mlx5_0\"\nrdma_devices = { gpu02 = \"mlx5_2\" }\n[slurm]\nserver_gpus = 1\n",
    )
    .unwrap();
    assert_eq!(s.fabric.device_for(Some("gpu02")).as_deref(), Some("mlx5_2"));
    assert_eq!(s.fabric.device_for(Some("gpu01")).as_deref(), Some("mlx5_0"));
    assert_eq!(s.fabric.device_for(None).as_deref(), Some("mlx5_0"));
    assert_eq!(s.slurm.server_gpus, 1);
    let e = JobSpec::from_toml("[job]\n[model]\ndeclare = true\n[fabric]\nrdma_devices = { gpu02 = \"\" }\n")
        .unwrap_err()
        .to_string();
    assert!(e.contains("fabric.rdma_devices"), "{e}");
    let e = JobSpec::from_toml("[job]\n[model]\ndeclare = true\n[slurm]\nworker_cpus = 0\n").unwrap_err().to_string();
    assert!(e.contains("slurm.worker_cpus"), "{e}");
}

#[test]
fn full_spec_parses() {
    let s = JobSpec::from_toml(
        r#"
        [job]
        workers = 4
        servers = 2
        steps = 50
        consistency = "ssp"
        staleness = 3
        dtype = "bf16"
        [model]
        tensors = [{ name = "w", elements = 1000 }, { name = "b", elements = 10 }]
        [optimizer]
        kind = "adamw"
        lr = 0.001
        weight_decay = 0.01
        [lr_schedule]
        warmup_steps = 5
        decay = "cosine"
        "#,
    )
    .unwrap();
    assert_eq!(s.job.workers, 4);
    assert_eq!(s.dtype().unwrap(), DType::Bf16);
    assert_eq!(s.optimizer().unwrap().name(), "adamw");
    assert!(matches!(s.schedule().unwrap().decay, Decay::Cosine { total_steps: 50, .. }));
}

#[test]
fn the_fabric_section_is_optional_and_read() {
    let s = JobSpec::from_toml("[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]").unwrap();
    assert_eq!(s.fabric, FabricSection::default());
    let s = JobSpec::from_toml(
        "[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[fabric]\ntransport = \"rdma\"\nrdma_device = \"rxe0\"\nrdma_port = 1\ngid_index = 3",
    )
    .unwrap();
    assert_eq!(s.fabric.transport.as_deref(), Some("rdma"));
    assert_eq!((s.fabric.rdma_device.as_deref(), s.fabric.rdma_port, s.fabric.gid_index), (Some("rxe0"), Some(1), Some(3)));
}

#[test]
fn errors_name_the_field() {
    let cases = [
        ("[job]\nworkerz = 2\n[model]\ntensors = [{ name = \"w\", elements = 8 }]", "workerz"),
        ("[job]\nworkers = 0\n[model]\ntensors = [{ name = \"w\", elements = 8 }]", "job.workers"),
        ("[job]\nworkers = 65\n[model]\ntensors = [{ name = \"w\", elements = 8 }]", "at most 64 workers"),
        ("[job]\ndtype = \"f64\"\n[model]\ntensors = [{ name = \"w\", elements = 8 }]", "job.dtype"),
        ("[job]\n[model]\npreset = \"synthetic\"", "unknown field `preset`"),
        ("[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[optimizer]\nkind = \"lamb\"", "optimizer.kind"),
        ("[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[optimizer]\nlr = -1.0", "optimizer.lr"),
        ("[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[lr_schedule]\ndecay = \"exp\"", "lr_schedule.decay"),
        ("[job]\nworkers = \"two\"\n[model]\ntensors = [{ name = \"w\", elements = 8 }]", "workers"),
        ("[job]", "model.tensors"),
        ("[job]\n[model]\ndeclare = true\ntensors = [{ name = \"w\", elements = 4 }]", "model.declare"),
        ("[job]\nconsistency = \"ssp\"\nstaleness = 0\n[model]\ntensors = [{ name = \"w\", elements = 8 }]", "job.staleness"),
        ("[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[fabric]\ntransport = \"tcp\"", "fabric.transport"),
        ("[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[fabric]\nrdma_port = 0", "fabric.rdma_port"),
        ("[job]\naggregator = \"tpu\"\n[model]\ntensors = [{ name = \"w\", elements = 8 }]", "job.aggregator"),
        ("[job]\n[model]\ntensors = [{ name = \"w\", elements = 8 }]\n[fabric]\ndevice = \"mlx5_0\"", "device"),
        // 2^63 + 2^63 wraps to 0 in u64: refused, not wrapped.
        (
            "[job]\n[model]\ntensors = [{ name = \"a\", elements = 9223372036854775807 }, { name = \"b\", elements = 9223372036854775807 }, { name = \"c\", elements = 2 }]",
            "model.tensors.elements",
        ),
        ("[job]\nshard_bytes = 4096\n[model]\ntensors = [{ name = \"a\", elements = 1099511627776 }]", "job.shard_bytes"),
    ];
    for (text, field) in cases {
        let e = JobSpec::from_toml(text).unwrap_err().to_string();
        assert!(e.contains(field), "{text:?}: {e}");
    }
}

/// `model.init`: a framework's values by default when it declares the
/// tensors (and can seed: one replica, not ASP, a server-side optimizer, not
/// resumed), the servers' initialiser otherwise; the declared spec keeps
/// what was decided; a choice the job cannot honour is refused by name.
#[test]
fn first_values_come_from_the_declaring_framework_unless_the_job_cannot_take_them() {
    let spec = |job: &str, model: &str, opt: &str| {
        JobSpec::from_toml(&format!("[job]\nservers = 2\n{job}\n[model]\n{model}\n[optimizer]\nkind = \"{opt}\"\n"))
    };
    let seeded = |job: &str, model: &str, opt: &str| spec(job, model, opt).unwrap().seeded_by_worker();
    assert!(seeded("", "declare = true", "sgd"));
    assert!(!seeded("", "declare = true\ninit = \"servers\"", "sgd"));
    assert!(!seeded("", "tensors = [{ name = \"w\", elements = 8 }]", "adam"));
    assert!(seeded("", "tensors = [{ name = \"w\", elements = 8 }]\ninit = \"worker\"", "adam"));
    assert!(!seeded("replicas = 2", "declare = true", "sgd"), "a backup starts from the servers' values");
    assert!(!seeded("consistency = \"asp\"", "declare = true", "sgd"));
    assert!(!seeded("", "declare = true", "none"), "the framework keeps its own parameters");
    for (job, why) in [("replicas = 2", "replicas = 1"), ("consistency = \"asp\"", "BSP or SSP")] {
        let e = spec(job, "declare = true\ninit = \"worker\"", "sgd").unwrap_err().to_string();
        assert!(e.contains("model.init") && e.contains(why), "{e}");
    }
    let e = spec("", "declare = true\ninit = \"rank0\"", "sgd").unwrap_err().to_string();
    assert!(e.contains("model.init") && e.contains("\"rank0\""), "{e}");
    // Declared: the decision is written into the spec that names the tensors.
    let decl = [crate::declare::TensorDecl { name: "w".into(), elements: 8, dtype: eps_agg::DType::F32 }];
    for (model, want) in [("declare = true", true), ("declare = true\ninit = \"servers\"", false)] {
        let text = format!("[job]\nservers = 2\n[model]\n{model}\n[optimizer]\nkind = \"sgd\"\n");
        let fixed = crate::declare::fix(&text, &decl).unwrap();
        assert_eq!(JobSpec::from_toml(&fixed).unwrap().seeded_by_worker(), want, "{fixed}");
    }
}
