//! The protobuf codec, with one change: a request that does not decode is the caller's mistake.
//!
//! tonic-prost answers undecodable bytes (garbage, truncation, nesting past prost's recursion
//! limit) with `INTERNAL`, which tells a gateway that we failed and tempts it to retry the same
//! bytes forever. This codec answers `INVALID_ARGUMENT`, naming what prost found wrong.

use prost::Message;
use tonic::Status;
use tonic::codec::{BufferSettings, Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic_prost::{ProstCodec, ProstDecoder, ProstEncoder};

use super::error::Refusal;

/// [`ProstCodec`] with decoding failures reported as `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct StrictCodec<T, U>(ProstCodec<T, U>);

impl<T, U> Default for StrictCodec<T, U> {
    fn default() -> Self {
        Self(ProstCodec::default())
    }
}

impl<T, U> Codec for StrictCodec<T, U>
where
    T: Message + Send + 'static,
    U: Message + Default + Send + 'static,
{
    type Encode = T;
    type Decode = U;
    type Encoder = StrictEncoder<T>;
    type Decoder = StrictDecoder<U>;

    fn encoder(&mut self) -> Self::Encoder {
        StrictEncoder(self.0.encoder())
    }

    fn decoder(&mut self) -> Self::Decoder {
        StrictDecoder(self.0.decoder())
    }
}

/// Encodes like [`ProstEncoder`], the same bytes, without measuring the message first.
///
/// prost's `Message::encode` walks the whole message once to compute its length, only to check
/// that the buffer has room for it, then again to write it; tonic's buffer always has room (it
/// grows), so the first walk bought nothing but cost on every reply (`bench/RESULTS.md`, "the
/// reply's encoding"). `encode_raw` is the second walk alone.
#[derive(Debug)]
pub struct StrictEncoder<T>(ProstEncoder<T>);

impl<T: Message> Encoder for StrictEncoder<T> {
    type Item = T;
    type Error = Status;

    fn encode(&mut self, item: T, buf: &mut EncodeBuf<'_>) -> Result<(), Status> {
        item.encode_raw(buf);
        Ok(())
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}

/// Decodes like [`ProstDecoder`], failing with `INVALID_ARGUMENT`.
#[derive(Debug)]
pub struct StrictDecoder<U>(ProstDecoder<U>);

impl<U: Message + Default> Decoder for StrictDecoder<U> {
    type Item = U;
    type Error = Status;

    fn decode(&mut self, buf: &mut DecodeBuf<'_>) -> Result<Option<U>, Status> {
        self.0.decode(buf).map_err(|status| {
            Refusal::Malformed {
                detail: format!(
                    "the message is not a valid {}: {}",
                    std::any::type_name::<U>()
                        .rsplit("::")
                        .next()
                        .unwrap_or("message"),
                    status.message()
                ),
            }
            .into()
        })
    }

    fn buffer_settings(&self) -> BufferSettings {
        self.0.buffer_settings()
    }
}
