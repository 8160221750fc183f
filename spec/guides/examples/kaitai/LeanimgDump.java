// Parse lean images with the Java parser generated from ksy/leanimg.ksy and print every
// field as JSON, one line per file (the shape is described in spec/guides/kaitai.md).
//
// Build and run (Leanimg.java from kaitai-struct-compiler -t java, runtime
// io.kaitai:kaitai-struct-runtime:0.11 from Maven Central):
//   javac -cp kaitai-struct-runtime-0.11.jar -d classes Leanimg.java LeanimgDump.java
//   java -cp classes:kaitai-struct-runtime-0.11.jar LeanimgDump IMAGE...
// Exit status 1 when an image did not parse (its line then carries "error").

import io.kaitai.struct.ByteBufferKaitaiStream;
import io.kaitai.struct.KaitaiStream;
import io.kaitai.struct.KaitaiStruct;

import java.lang.reflect.Field;
import java.lang.reflect.InvocationTargetException;
import java.lang.reflect.Method;
import java.lang.reflect.Modifier;
import java.security.MessageDigest;
import java.security.NoSuchAlgorithmException;
import java.util.HexFormat;
import java.util.List;

public class LeanimgDump {
    /** Longer byte strings are printed as their size and SHA-256. */
    static final int SHORT_BYTES = 64;

    public static void main(String[] args) throws Exception {
        if (args.length == 0) {
            System.err.println("usage: java LeanimgDump IMAGE...");
            System.exit(2);
        }
        boolean failed = false;
        StringBuilder out = new StringBuilder();
        for (String image : args) {
            out.setLength(0);
            try (ByteBufferKaitaiStream io = new ByteBufferKaitaiStream(image)) {
                Leanimg parsed = new Leanimg(io);
                out.append("{\"file\":").append(string(image)).append(",\"leanimg\":");
                struct(out, parsed, true);
                out.append('}');
            } catch (Exception e) {
                Throwable cause = e instanceof InvocationTargetException ? e.getCause() : e;
                failed = true;
                out.setLength(0);
                out.append("{\"file\":").append(string(image)).append(",\"error\":")
                   .append(string(cause.getClass().getSimpleName() + ": " + cause.getMessage())).append('}');
            }
            System.out.println(out);
        }
        System.exit(failed ? 1 : 0);
    }

    /**
     * A struct's fields by reflection: every private field of the generated class is a seq field,
     * a parameter or an instance, read through its getter of the same name. Struct-valued
     * instances below the root (footer.index, index_entry.record) re-read records already printed
     * in "records" and are left out: such a field is still null when its struct is printed.
     */
    static void struct(StringBuilder out, KaitaiStruct struct, boolean atRoot) throws Exception {
        out.append("{\"_type\":").append(string(struct.getClass().getSimpleName()));
        for (Field field : struct.getClass().getDeclaredFields()) {
            String name = field.getName();
            if (Modifier.isStatic(field.getModifiers()) || (name.startsWith("_") && !name.startsWith("_raw_"))) {
                continue;
            }
            field.setAccessible(true);
            boolean unread = field.get(struct) == null;
            if (unread && KaitaiStruct.class.isAssignableFrom(field.getType()) && !atRoot) {
                continue;
            }
            Object value = getter(struct, name).invoke(struct);
            if (value == null) {
                continue;                       // an absent field (if: false), or an enum value the .ksy does not name
            }
            if (value instanceof KaitaiStruct && ((KaitaiStruct) value)._io() != struct._io()
                    && !hasField(struct, "_raw_" + name)) {
                member(out, "_raw_" + name);    // a sized field parsed as a type (a substream): its bytes too
                bytes(out, wholeStream(((KaitaiStruct) value)._io()));
            }
            member(out, name);
            value(out, value);
        }
        out.append('}');
    }

    static boolean hasField(KaitaiStruct struct, String name) {
        try {
            struct.getClass().getDeclaredField(name);
            return true;
        } catch (NoSuchFieldException e) {
            return false;
        }
    }

    static Method getter(KaitaiStruct struct, String name) throws NoSuchMethodException {
        Method method = struct.getClass().getMethod(name);
        method.setAccessible(true);
        return method;
    }

    static void member(StringBuilder out, String camelName) {
        out.append(',').append(string(camelName.replaceAll("([A-Z])", "_$1").toLowerCase())).append(':');
    }

    static void value(StringBuilder out, Object value) throws Exception {
        if (value instanceof Long) {
            out.append(Long.toUnsignedString((Long) value));      // u8 and u4 are read into long
        } else if (value instanceof Number || value instanceof Boolean) {
            out.append(value);
        } else if (value instanceof String) {
            out.append(string((String) value));
        } else if (value instanceof byte[]) {
            bytes(out, (byte[]) value);
        } else if (value instanceof Enum) {
            out.append(Long.toUnsignedString((Long) value.getClass().getMethod("id").invoke(value)));
        } else if (value instanceof List) {
            out.append('[');
            boolean first = true;
            for (Object item : (List<?>) value) {
                if (!first) out.append(',');
                first = false;
                value(out, item);
            }
            out.append(']');
        } else if (value instanceof KaitaiStruct) {
            struct(out, (KaitaiStruct) value, false);
        } else {
            throw new IllegalArgumentException("cannot print a " + value.getClass().getName());
        }
    }

    static byte[] wholeStream(KaitaiStream io) {
        long pos = io.pos();
        io.seek(0);
        byte[] data = io.readBytesFull();
        io.seek(pos);
        return data;
    }

    static void bytes(StringBuilder out, byte[] data) throws NoSuchAlgorithmException {
        if (data.length <= SHORT_BYTES) {
            out.append("{\"hex\":\"").append(HexFormat.of().formatHex(data)).append("\"}");
        } else {
            byte[] sha256 = MessageDigest.getInstance("SHA-256").digest(data);
            out.append("{\"size\":").append(data.length).append(",\"sha256\":\"")
               .append(HexFormat.of().formatHex(sha256)).append("\"}");
        }
    }

    static String string(String s) {
        StringBuilder json = new StringBuilder("\"");
        for (char c : s.toCharArray()) {
            if (c == '"' || c == '\\') {
                json.append('\\').append(c);
            } else if (c < 0x20) {
                json.append(String.format("\\u%04x", (int) c));
            } else {
                json.append(c);
            }
        }
        return json.append('"').toString();
    }
}
