//! Generates the gRPC code from `proto/` with protox, so that no system `protoc` is needed, and
//! writes the file descriptor set that server reflection serves.

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    println!("cargo:rerun-if-changed=proto");
    // `refinery::embed_migrations!` reads `migrations/` when the crate compiles but does not tell
    // Cargo so: without this, a new migration file left the build as it was.
    println!("cargo:rerun-if-changed=migrations");
    let fds = protox::compile(
        ["turnstile/v1/turn.proto", "turnstile/v1/admin.proto"],
        ["proto"],
    )?;
    let out_dir = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    std::fs::write(
        out_dir.join("turnstile_descriptor.bin"),
        fds.encode_to_vec(),
    )?;
    // The bot worker contract is generated with the rest (the same package), but left out of
    // the reflection descriptors: Turnstile calls `BotWorker`, it does not serve it.
    let fds = protox::compile(
        [
            "turnstile/v1/turn.proto",
            "turnstile/v1/worker.proto",
            "turnstile/v1/admin.proto",
        ],
        ["proto"],
    )?;
    // Undecodable requests are the caller's mistake: see src/grpc/codec.rs.
    tonic_prost_build::configure()
        .codec_path("crate::grpc::codec::StrictCodec")
        // The typed activity is by far the request's largest field; boxed, the request that
        // tonic's layers move from future to future is a few words instead of a kilobyte
        // (callgrind, bench/RESULTS.md).
        .boxed(".turnstile.v1.ProcessTurnRequest.input.activity")
        .compile_fds(fds)?;
    Ok(())
}
