//! Compiles the RocketMQ 5 gRPC protocol (`proto/apache/rocketmq/v2`, vendored from apache/rocketmq-apis at
//! commit 3e60073c6dab3430feaec443824802e23ecda681) into Rust with protox, a pure-Rust protobuf compiler, so
//! building popgate needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    // protox bundles google/protobuf/{duration,timestamp}.proto; only the vendored folder is given.
    // popgate's own peer link between the instances of a tier (`proto/popgate/peer/v1`) is compiled alongside.
    let descriptors = protox::compile(["apache/rocketmq/v2/service.proto", "popgate/peer/v1/peer.proto"], ["proto"])?;
    tonic_prost_build::configure()
        .build_server(true)
        // The client is for the it/ tests, which speak to the front directly where the SDK cannot (foreign handles).
        .build_client(true)
        // RPCs popgate does not serve answer UNIMPLEMENTED instead of needing a body each.
        .generate_default_stubs(true)
        .bytes(".apache.rocketmq.v2.Message.body")
        .compile_fds(descriptors)?;
    println!("cargo:rerun-if-changed=proto");
    Ok(())
}
