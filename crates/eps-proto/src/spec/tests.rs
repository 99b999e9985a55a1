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
    let s = JobSpec::from_toml("[job]\n[model]\npreset = \"synthetic\"").unwrap();
    assert_eq!(s.fabric, FabricSection::default());
    let s = JobSpec::from_toml(
        "[job]\n[model]\npreset = \"synthetic\"\n[fabric]\ntransport = \"rdma\"\nrdma_device = \"rxe0\"\nrdma_port = 1\ngid_index = 3",
    )
    .unwrap();
    assert_eq!(s.fabric.transport.as_deref(), Some("rdma"));
    assert_eq!((s.fabric.rdma_device.as_deref(), s.fabric.rdma_port, s.fabric.gid_index), (Some("rxe0"), Some(1), Some(3)));
}

#[test]
fn errors_name_the_field() {
    let cases = [
        ("[job]\nworkerz = 2\n[model]\npreset = \"synthetic\"", "workerz"),
        ("[job]\nworkers = 0\n[model]\npreset = \"synthetic\"", "job.workers"),
        ("[job]\ndtype = \"f64\"\n[model]\npreset = \"synthetic\"", "job.dtype"),
        ("[job]\n[model]\npreset = \"resnet\"", "model.preset"),
        ("[job]\n[model]\npreset = \"synthetic\"\n[optimizer]\nkind = \"lamb\"", "optimizer.kind"),
        ("[job]\n[model]\npreset = \"synthetic\"\n[optimizer]\nlr = -1.0", "optimizer.lr"),
        ("[job]\n[model]\npreset = \"synthetic\"\n[lr_schedule]\ndecay = \"exp\"", "lr_schedule.decay"),
        ("[job]\nworkers = \"two\"\n[model]\npreset = \"synthetic\"", "workers"),
        ("[job]", "model.tensors"),
        ("[job]\n[model]\npreset = \"synthetic\"\ndeclare = true", "model.declare"),
        ("[job]\n[model]\ndeclare = true\ntensors = [{ name = \"w\", elements = 4 }]", "model.declare"),
        ("[job]\nconsistency = \"ssp\"\nstaleness = 0\n[model]\npreset = \"synthetic\"", "job.staleness"),
        ("[job]\n[model]\npreset = \"synthetic\"\n[fabric]\ntransport = \"tcp\"", "fabric.transport"),
        ("[job]\n[model]\npreset = \"synthetic\"\n[fabric]\nrdma_port = 0", "fabric.rdma_port"),
        ("[job]\naggregator = \"tpu\"\n[model]\npreset = \"synthetic\"", "job.aggregator"),
        ("[job]\n[model]\npreset = \"synthetic\"\n[fabric]\ndevice = \"mlx5_0\"", "device"),
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
